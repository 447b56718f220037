"""DRY ("Don't Repeat Yourself"): a penalty that grows exponentially with the repeat it extends.

The penalty of text-generation-webui's `DRYLogitsProcessor` (modules/sampler_hijack.py,
introduced in its pull request #5677) and llama.cpp's `dry_*` sampler settings, per row:

- `multiplier` (0 = off), `base`, `allowed_length`: a token `t` that would extend a
  repeat gets `multiplier * base ** (m - allowed_length)` subtracted from its logit, where
  `m` is the length of the longest match: the row's last `m` tokens also occur earlier,
  immediately followed by `t`. Only matches with `m >= allowed_length` are penalised (and
  `m >= 1` always).
- `sequence_breakers`: token ids that end a match. If the row's last token is a breaker
  nothing is penalised; a match does not extend backwards over a breaker; a breaker is
  never penalised as the continuation `t`.
- `penalty_range`: only the row's last `penalty_range` tokens are searched (0 = all).
- `m` is capped at `MAX_MATCH = 50`, as the reference caps it (it keeps `base ** m` finite
  for the usual bases and bounds the search).

The row's tokens are its prompt and generated tokens, as in the reference (it reads the
whole `input_ids`). What it does to the distribution: the penalised tokens' probabilities
shrink by the factor `exp(-penalty)` relative to the others (before temperature, so the
factor is then raised to 1 / T); nothing is ever removed outright unless the penalty
overflows float32 to inf (large `base ** m`), which bans the token. The penalty is
computed in float32 (`base ** (m - allowed_length)` as a float32 power).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling.checks import (
    _check_ids,
    _check_range,
    _id_lists,
    _pad_ids,
    _per_row,
)
from logitloop.decoding.sampling.processors import Step
from logitloop.processors._matching import (
    check_batch_size,
    require_history,
    scatter_rows,
    suffix_match_lengths,
)

MAX_MATCH = 50  # the reference's cap on the match length
_MAX_INT32 = 2**31 - 1


@struct.dataclass
class DRY:
    """Subtract an exponentially growing penalty from tokens that would extend a repeat.

    Runs after the penalties (step 3) and before temperature. Build with `DRY.create`.
    """

    multiplier: jax.Array  # [B] f32 >= 0, 0 = off for that row
    base: jax.Array  # [B] f32 >= 1
    allowed_length: jax.Array  # [B] i32 >= 0: longest repeat that goes unpenalised
    penalty_range: jax.Array  # [B] i32 >= 0: last n tokens searched, 0 = all
    sequence_breakers: jax.Array  # [B, Nb] i32 token ids, -1 = unused slot

    @classmethod
    def create(
        cls,
        batch_size: int,
        *,
        multiplier: Any = 0.0,
        base: Any = 1.75,
        allowed_length: Any = 2,
        penalty_range: Any = 0,
        sequence_breakers: Any = None,
        vocab_size: int | None = None,
    ) -> DRY:
        """Validate on the host and build the per-row pytree.

        Scalars apply to every row; a sequence gives one value per row. Defaults are the
        reference's (multiplier 0 = off, base 1.75, allowed_length 2). `sequence_breakers`
        takes token ids (the reference's strings must be tokenised by the caller): one list
        for every row, or one list (or None) per row. `vocab_size`, when given, bounds the
        breaker ids. Raises ValueError naming the argument, the row and the allowed range.
        """
        b = check_batch_size(batch_size)
        mult = _check_range("multiplier", _per_row("multiplier", multiplier, b), 0, float("inf"))
        bas = _check_range("base", _per_row("base", base, b), 1, float("inf"))
        allowed = _check_range(
            "allowed_length",
            _per_row("allowed_length", allowed_length, b),
            0,
            _MAX_INT32,
            integer=True,
        )
        last_n = _check_range(
            "penalty_range",
            _per_row("penalty_range", penalty_range, b),
            0,
            _MAX_INT32,
            integer=True,
        )
        breakers = _id_lists("sequence_breakers", sequence_breakers, b)
        _check_ids("sequence_breakers", breakers, vocab_size)
        return cls(
            multiplier=jnp.asarray(mult, jnp.float32),
            base=jnp.asarray(bas, jnp.float32),
            allowed_length=jnp.asarray(allowed, jnp.int32),
            penalty_range=jnp.asarray(last_n, jnp.int32),
            sequence_breakers=jnp.asarray(_pad_ids(breakers)),
        )

    def init(self, batch_size: int, vocab_size: int) -> jax.Array:
        return jnp.zeros((batch_size, 0), jnp.int32)  # stateless: reads step.history

    def apply(self, state: jax.Array, logits: jax.Array, step: Step) -> jax.Array:
        history = require_history(step, "DRY")
        tokens = history.tokens  # [B, C]
        cap = tokens.shape[1]
        col = jnp.arange(cap)[None, :]  # [1, C]
        valid = self.sequence_breakers >= 0  # [B, Nb]
        is_breaker = jnp.any(
            (tokens[:, :, None] == self.sequence_breakers[:, None, :]) & valid[:, None, :],
            axis=-1,
        )  # [B, C]
        ranged = self.penalty_range > 0
        start = jnp.where(ranged, jnp.maximum(history.length - self.penalty_range, 0), 0)
        limit = jnp.full_like(self.allowed_length, MAX_MATCH)
        m = suffix_match_lengths(history, limit, start, stop=is_breaker)  # [B, C]
        # s[i] (i < length) continues a repeat of length m[i]; penalise the longest per token.
        # m = 0 (no repeat) scatters 0, which the last line leaves alone, so m >= 1 always.
        on = self.multiplier > 0  # [B]
        hit = (
            (col < history.length[:, None])
            & (m >= self.allowed_length[:, None])
            & ~is_breaker
            & on[:, None]
        )
        ids = jnp.where(hit, tokens, -1)
        longest = scatter_rows(jnp.where(hit, m, 0), ids, logits.shape[1], 0)  # [B, V] i32
        exponent = (longest - self.allowed_length[:, None]).astype(jnp.float32)
        penalty = self.multiplier[:, None] * jnp.power(self.base[:, None], exponent)
        return jnp.where(longest > 0, logits - penalty, logits)

    def update(self, state: jax.Array, tokens: jax.Array, step: Step) -> jax.Array:
        return state
