"""What the repetition processors share: host-side checks and the suffix match over a `History`.

`suffix_match_lengths` answers, for every position `i` of a row's tokens `s = tokens[:L]`:
how many tokens right before `i` repeat the row's last tokens? That is the largest `m` with

    s[i - 1 - k] == s[L - 1 - k]   for k = 0 .. m - 1.

If `s[i - m : i]` equals the suffix `s[L - m : L]`, then drawing `s[i]` next repeats the
(m + 1)-gram `s[i - m : i + 1]`. No-repeat n-gram bans `s[i]` when `m >= n - 1`; DRY
penalises `s[i]` by a function of `m`.

Worked example, s = [7, 1, 2, 9, 1, 2] (L = 6, suffix ... 1, 2):
  i      0  1  2  3  4  5
  m      0  0  0  2  0  0     (i = 3: s[1:3] = [1, 2] = s[4:6]; s[0] = 7 != s[3] = 9)
so `9` would repeat the 3-gram [1, 2, 9].

The loop runs over k, not over rows or positions: each step compares every position of
every row at once ([B, C] work) and it stops as soon as no run is still growing, so its
cost is O(B * C * (longest match + 1)), bounded by the per-row `limit`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.processors import Step


def check_batch_size(batch_size: Any) -> int:
    """`batch_size` as an int, or ValueError (worded as `SamplingParams.create` words it)."""
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)):
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size} is outside the allowed range [1, inf)")
    return int(batch_size)


def require_history(step: Step, name: str) -> History:
    """The step's history; a processor that reads tokens cannot run without one."""
    if step.history is None:
        raise ValueError(
            f"{name} reads the row's tokens but step.history is None: pass a History "
            "(generate, stream and generate_many always do)"
        )
    return step.history


def suffix_match_lengths(
    history: History,
    limit: jax.Array,  # [B] i32: stop counting at this many tokens (<= 0: nothing counted)
    start: jax.Array,  # [B] i32: the earlier occurrence may not reach before this column
    stop: jax.Array | None = None,  # [B, C] bool: a suffix token where the match must end
) -> jax.Array:  # [B, C] i32
    """m[b, i] as in the module docstring, for i < length[b] (0 elsewhere).

    A match also ends before column `start[b]` (the earlier tokens are out of range) and
    at a suffix token flagged in `stop` (that token and everything before it do not count).
    """
    tokens = history.tokens  # [B, C]
    batch, cap = tokens.shape
    col = jnp.arange(cap)  # [C]
    last = history.length - 1  # [B]

    def grow(carry):
        k, run, m = carry
        j = col - 1 - k  # [C] where the earlier occurrence reads
        q = last - k  # [B] where the suffix reads
        earlier = jnp.take(tokens, jnp.clip(j, 0, cap - 1), axis=1)  # [B, C]
        q_col = jnp.clip(q, 0, cap - 1)[:, None]  # [B, 1]
        suffix = jnp.take_along_axis(tokens, q_col, axis=1)  # [B, 1]
        ok = (q >= 0) & (k < limit)  # [B]
        if stop is not None:
            ok = ok & ~jnp.take_along_axis(stop, q_col, axis=1)[:, 0]
        run = run & ok[:, None] & (j[None, :] >= start[:, None]) & (earlier == suffix)
        return k + 1, run, m + run.astype(jnp.int32)

    def growing(carry):
        k, run, _ = carry
        return (k < k_max) & jnp.any(run)

    k_max = jnp.max(limit)
    run0 = col[None, :] < history.length[:, None]  # [B, C]
    m0 = jnp.zeros((batch, cap), jnp.int32)
    _, _, m = jax.lax.while_loop(growing, grow, (jnp.int32(0), run0, m0))
    return m


def scatter_rows(values: jax.Array, ids: jax.Array, vocab_size: int, fill: Any) -> jax.Array:
    """[B, V] table, `fill` everywhere, then for every (b, c) with 0 <= ids[b, c] < V the
    max over c of `values[b, c]` at column ids[b, c] (ids outside [0, V) are dropped)."""
    batch = ids.shape[0]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape)
    cols = jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # -> dropped
    table = jnp.full((batch, vocab_size), fill, values.dtype)
    return table.at[rows, cols].max(values, mode="drop")
