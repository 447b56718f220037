"""The tokens a row has seen, as the penalties need them.

`History` keeps each row's prompt and generated tokens in one fixed-size buffer, so it can
live inside a jit-compiled loop. The penalties never build a `[B, V]` count table: they sort
the row's (at most `capacity`) tokens and touch only the distinct ones (`distinct_tokens`),
which costs O(C log C) per row instead of a pass over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_EMPTY = jnp.iinfo(jnp.int32).max  # sorts after every real token id
MAX_VOCAB = 2**30  # `distinct_tokens` packs (id, flag) into one int32


@struct.dataclass
class History:
    """Prompt plus generated tokens per row.

    Row `r` holds its prompt in `tokens[r, :num_prompt[r]]` and its generated tokens in
    `tokens[r, num_prompt[r]:length[r]]`; the rest is -1.
    """

    tokens: jax.Array  # [B, C] i32, -1 = empty slot
    num_prompt: jax.Array  # [B] i32
    length: jax.Array  # [B] i32, prompt + generated so far

    @classmethod
    def create(
        cls,
        prompt_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        capacity: int = 256,
    ) -> History:
        """Build a history from per-row prompts with room for `capacity` generated tokens.

        Appending past the capacity is dropped (`append` never writes out of bounds);
        `generate` sizes the history so that this cannot happen.
        """
        rows = [list(map(int, p)) for p in prompt_token_ids]
        if not 0 < vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size = {vocab_size} is outside the allowed range [1, 2^30]")
        if not rows:
            raise ValueError("prompt_token_ids is empty: need one (possibly empty) list per row")
        if capacity < 0:
            raise ValueError(f"capacity = {capacity} is outside the allowed range [0, inf)")
        for r, ids in enumerate(rows):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(
                        f"prompt_token_ids[{r}] holds token id {t}, outside the vocabulary "
                        f"range [0, {vocab_size - 1}]"
                    )
        width = max(len(r) for r in rows) + int(capacity)
        buf = np.full((len(rows), max(width, 1)), -1, np.int32)
        for i, ids in enumerate(rows):
            buf[i, : len(ids)] = ids
        lengths = np.asarray([len(r) for r in rows], np.int32)
        return cls(jnp.asarray(buf), jnp.asarray(lengths), jnp.asarray(lengths))

    @classmethod
    def empty(cls, batch_size: int, capacity: int) -> History:
        """A history with no prompt tokens, e.g. for a decode loop that fills it itself."""
        return cls(
            jnp.full((batch_size, capacity), -1, jnp.int32),
            jnp.zeros((batch_size,), jnp.int32),
            jnp.zeros((batch_size,), jnp.int32),
        )

    def append(self, tokens: jax.Array, where: jax.Array | None = None) -> History:
        """Append one generated token per row (rows with `where == False` are untouched)."""
        batch, cap = self.tokens.shape
        write = self.length < cap
        if where is not None:
            write = write & where
        col = jnp.where(write, self.length, cap)  # out of range -> dropped
        tokens_buf = self.tokens.at[jnp.arange(batch), col].set(
            tokens.astype(jnp.int32), mode="drop"
        )
        return self.replace(tokens=tokens_buf, length=self.length + write.astype(jnp.int32))

    def generated_count(self) -> jax.Array:
        """[B] i32: how many tokens each row has generated."""
        return self.length - self.num_prompt


@struct.dataclass
class DistinctTokens:
    """The distinct tokens of each row of a `History`, one entry per token id.

    Entries are sorted by token id; only entries with `is_distinct` set stand for a token
    (the others are duplicates or empty slots and must be ignored).
    """

    ids: jax.Array  # [B, C] i32, sorted; empty slots hold INT32_MAX
    generated_count: jax.Array  # [B, C] i32, times the token was generated (prompt excluded)
    is_distinct: jax.Array  # [B, C] bool, one True per distinct token id


def distinct_tokens(history: History) -> DistinctTokens:
    """Sort each row's tokens and count generated occurrences per distinct token.

    Worked example, one row, prompt [5, 3], generated [3, 5, 5], capacity slot empty:
      tokens        [5, 3, 3, 5, 5, -1]
      is_generated  [0, 0, 1, 1, 1,  0]
      sorted ids    [3, 3, 5, 5, 5, MAX]   sorted flags [0, 1, 0, 1, 1, 0]
      run end       [0, 1, 0, 0, 1, 1]     count at run end: 3 -> 1, 5 -> 2
    """
    tokens = history.tokens
    cap = tokens.shape[1]
    col = jnp.arange(cap)[None, :]  # [1, C]
    valid = tokens >= 0
    is_gen = (valid & (col >= history.num_prompt[:, None])).astype(jnp.int32)
    # One int32 key per entry, token id then the generated flag: XLA:CPU sorts a single
    # array several times faster than (ids, flags) pairs. Ids are below 2^30 (`create`).
    packed = jnp.sort(jnp.where(valid, tokens * 2 + is_gen, _EMPTY), axis=1)  # [B, C]
    ids = jnp.where(packed == _EMPTY, _EMPTY, packed >> 1)
    gen = jnp.where(packed == _EMPTY, 0, packed & 1)
    differs = ids[:, 1:] != ids[:, :-1]  # [B, C-1]
    ones = jnp.ones_like(ids[:, :1], bool)
    run_start = jnp.concatenate([ones, differs], axis=1)
    run_end = jnp.concatenate([differs, ones], axis=1)
    start = jax.lax.cummax(jnp.where(run_start, col, 0), axis=1)  # first index of each run
    csum = jnp.cumsum(gen, axis=1)
    before = jnp.take_along_axis(csum - gen, start, axis=1)  # generated count before the run
    return DistinctTokens(
        ids=ids,
        generated_count=csum - before,
        is_distinct=run_end & (ids != _EMPTY),
    )
