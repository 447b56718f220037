"""No-repeat n-gram: a token that would complete an n-gram already in the row gets -inf.

What it does to the distribution: with `size = n`, let `s` be the row's tokens so far
(prompt and generated). Every token `t` such that `s[-(n-1):] + [t]` already occurs as n
consecutive tokens of `s` gets probability 0; the other tokens keep their logits, so
their probabilities are renormalised among themselves. `n = 1` bans every token the row
has seen. If every token is banned the row is all -inf, which the sampler reports as its
all-masked outcome.

The prompt counts, as in `transformers.NoRepeatNGramLogitsProcessor` (which reads the
whole `input_ids`, prompt included): an n-gram of the prompt is never generated again.
Until the row holds n tokens nothing is banned (no complete n-gram yet).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling.checks import _check_range, _per_row
from logitloop.decoding.sampling.processors import Step
from logitloop.processors._matching import (
    check_batch_size,
    require_history,
    scatter_rows,
    suffix_match_lengths,
)

_MAX_INT32 = 2**31 - 1


@struct.dataclass
class NoRepeatNGram:
    """Ban every token that would repeat an n-gram of the row (prompt included).

    Runs after the penalties (step 3) and before temperature, like every processor
    without `after_temperature`. Build with `NoRepeatNGram.create`.
    """

    size: jax.Array  # [B] i32 >= 0: the n of the n-grams, 0 = off for that row

    @classmethod
    def create(cls, batch_size: int, size: Any = 0) -> NoRepeatNGram:
        """`size`: one int for every row or one per row, in [0, 2^31 - 1]; 0 = off.

        Raises ValueError naming the argument, the row and the allowed range.
        """
        b = check_batch_size(batch_size)
        n = _check_range("size", _per_row("size", size, b), 0, _MAX_INT32, integer=True)
        return cls(size=jnp.asarray(n, jnp.int32))

    def init(self, batch_size: int, vocab_size: int) -> jax.Array:
        return jnp.zeros((batch_size, 0), jnp.int32)  # stateless: reads step.history

    def apply(self, state: jax.Array, logits: jax.Array, step: Step) -> jax.Array:
        history = require_history(step, "NoRepeatNGram")
        # s[i] completes a repeated n-gram iff the n - 1 tokens before it equal the row's
        # last n - 1 tokens (`suffix_match_lengths`); n = 1 bans every s[i].
        need = self.size - 1  # [B]
        start = jnp.zeros_like(self.size)
        m = suffix_match_lengths(history, need, start)  # [B, C]
        cap = history.tokens.shape[1]
        seen = jnp.arange(cap)[None, :] < history.length[:, None]  # [B, C]
        hit = seen & (m >= need[:, None]) & (self.size > 0)[:, None]
        ids = jnp.where(hit, history.tokens, -1)
        banned = scatter_rows(hit, ids, logits.shape[1], False)  # [B, V] bool
        return jnp.where(banned, -jnp.inf, logits)

    def update(self, state: jax.Array, tokens: jax.Array, step: Step) -> jax.Array:
        return state
