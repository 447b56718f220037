"""Locally typical sampling (Meister et al. 2022, "Locally Typical Sampling").

What it does to the distribution: with `p = softmax(logits)` and its entropy
`H = -sum p log p`, every token is scored by how far its surprisal is from the expected
surprisal, `|-log p(t) - H|`. Tokens are taken in increasing order of that score until
their probability reaches `mass`; the others get -inf, and the kept tokens are
renormalised among themselves. Unlike top-p this may drop the most likely token (when it
is far less surprising than average).

As `transformers.TypicalLogitsWarper(mass, min_tokens_to_keep=1)`: the kept set is every
token whose score is at most the score of the first token (in score order) at which the
cumulative probability reaches `mass` (so ties at the boundary are kept), and at least
the token with the smallest score. The probability sums are float32 sums in another order
than transformers' cumulative sum, so the two can differ when the mass at the boundary
equals `mass` to within rounding. It runs after temperature, top-k, top-p and min-p
on the scaled logits (`after_filters = True`, the cut tokens at -inf), as `transformers`
orders its warpers (typical after min-p). A row whose logits are all -inf is returned
unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling.checks import _check_range, _per_row
from logitloop.decoding.sampling.processors import Step
from logitloop.processors._matching import check_batch_size

_INF_KEY = 0x7F800000  # float32 +inf as int32 bits


@struct.dataclass
class TypicalP:
    """Keep the most typical tokens up to probability `mass`. Build with `TypicalP.create`."""

    mass: jax.Array  # [B] f32 in (0, 1], 1 = off for that row

    after_filters = True  # a class attribute, not a field: runs after the filters

    @classmethod
    def create(cls, batch_size: int, mass: Any = 1.0) -> TypicalP:
        """`mass`: one float for every row or one per row, in (0, 1]; 1 = off.

        Raises ValueError naming the argument, the row and the allowed range.
        """
        b = check_batch_size(batch_size)
        m = _check_range("mass", _per_row("mass", mass, b), 0, 1, lo_open=True)
        return cls(mass=jnp.asarray(m, jnp.float32))

    def init(self, batch_size: int, vocab_size: int) -> jax.Array:
        return jnp.zeros((batch_size, 0), jnp.int32)  # stateless

    def apply(self, state: jax.Array, logits: jax.Array, step: Step) -> jax.Array:
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, V]; an all -inf row is NaN
        p = jnp.exp(logp)
        entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1, keepdims=True)  # [B, 1]
        score = jnp.abs(-logp - entropy)  # [B, V] >= 0; inf for -inf logits, NaN rows NaN
        # The kept set is {score <= tau} for the smallest tau among the scores whose set
        # holds probability >= mass. Found without sorting: a bisection over the bits of a
        # non-negative float32 (their int32 order is their value order), 31 masked sums per
        # row. Tied scores enter together, as transformers' sorted cumulative sum keeps
        # every score equal to the one at which it reaches `mass`.
        key = jax.lax.bitcast_convert_type(score, jnp.int32)  # [B, V]

        def halve(_, bounds):  # invariant: mass(lo) < mass <= mass(hi), or hi = +inf
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            reach = jnp.sum(jnp.where(key <= mid[:, None], p, 0.0), axis=-1) >= self.mass
            return jnp.where(reach, lo, mid), jnp.where(reach, mid, hi)

        batch = logits.shape[0]
        lo = jnp.full((batch,), -1, jnp.int32)
        hi = jnp.full((batch,), _INF_KEY, jnp.int32)  # never reached (rounding): keep all
        _, hi = jax.lax.fori_loop(0, 31, halve, (lo, hi))
        tau = jax.lax.bitcast_convert_type(hi, jnp.float32)  # [B]
        # score > tau is False for the smallest score (kept: min_tokens_to_keep = 1) and
        # for NaN rows (their masked sums are NaN, so tau stays +inf): they pass through.
        drop = (score > tau[:, None]) & (self.mass < 1)[:, None]
        return jnp.where(drop, -jnp.inf, logits)

    def update(self, state: jax.Array, tokens: jax.Array, step: Step) -> jax.Array:
        return state
