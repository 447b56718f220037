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
the token with the smallest score. It runs after temperature on the scaled logits
(`after_temperature = True`), before top-k, top-p and min-p, as `transformers` orders its
warpers. A row whose logits are all -inf is returned unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.params import _check_range, _per_row
from logitloop.decoding.processors import Step
from logitloop.processors._matching import check_batch_size


@struct.dataclass
class TypicalP:
    """Keep the most typical tokens up to probability `mass`. Build with `TypicalP.create`."""

    mass: jax.Array  # [B] f32 in (0, 1], 1 = off for that row

    after_temperature = True  # a class attribute, not a field: runs on the scaled logits

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
        vocab = logits.shape[1]
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, V]; an all -inf row is NaN
        p = jnp.exp(logp)
        entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1, keepdims=True)  # [B, 1]
        score = jnp.abs(-logp - entropy)  # [B, V]; inf for -inf logits
        sorted_score, sorted_p = jax.lax.sort((score, p), dimension=1, num_keys=1)
        below = jnp.cumsum(sorted_p, axis=-1) < self.mass[:, None]  # [B, V]
        last = jnp.minimum(jnp.sum(below, axis=-1), vocab - 1)  # [B]
        threshold = jnp.take_along_axis(sorted_score, last[:, None], axis=1)  # [B, 1]
        # score > threshold is False for the smallest score (and for NaN rows).
        drop = (score > threshold) & (self.mass < 1)[:, None]
        return jnp.where(drop, -jnp.inf, logits)

    def update(self, state: jax.Array, tokens: jax.Array, step: Step) -> jax.Array:
        return state
