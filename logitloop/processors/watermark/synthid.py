"""SynthID Text (Dathathri et al., Nature 2024), as transformers'
`SynthIDTextWatermarkLogitsProcessor` computes it.

Each step hashes the row's context, its last `ngram_len - 1` generated tokens (zeros
before the first ones: the prompt is not read, as in transformers), then for every
candidate token `t` and watermarking key `k_d` (d = 1 .. depth) draws a g-value
`g_d(t) = table[hash(context, t, k_d) mod S]` in {0, 1}, where `hash` is transformers'
int64 linear congruential `accumulate_hash` (`u64`) and `table = randint(0, 2, (S,))` from
`sampling_table_seed` (`torch_random`). Tournament sampling with two leaves per match,
vectorised as transformers does it: with p the softmax of the scores,

    for d in 1 .. depth:  p <- p * (1 + g_d - sum_t g_d(t) p(t))

and the scores become log p (a zero probability becomes the float32 minimum). The row's
logits are left alone when its context hash was seen in its last `context_history_size`
steps (a repeated context would bias the text without adding evidence), and during its
first `ngram_len - 1` steps when `skip_first_ngram_calls` is set.

The detector's mean score (`detect.synthid_score`) averages the g-values of a text's
n-grams over depth and positions.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.sampling.checks import _check_range, _per_row, row_name
from logitloop.decoding.sampling.processors import Step
from logitloop.processors._matching import check_batch_size, require_history
from logitloop.processors.watermark import u64
from logitloop.processors.watermark.torch_random import coin_table

MULTIPLIER = 6364136223846793005  # accumulate_hash's LCG multiplier (newlib/musl)
MAX_NGRAM_LEN = 32  # the context is read through a static slice this wide
MAX_TABLE_SIZE = 2**24  # transformers' bound on sampling_table_size
_INT64 = (-(2**63), 2**63 - 1)


def accumulate(h: u64.U64, data: u64.U64) -> u64.U64:
    """transformers' `accumulate_hash` for one value: (h + data) * MULTIPLIER + 1."""
    return u64.add(u64.mul(u64.add(h, data), u64.const(MULTIPLIER)), u64.const(1))


def context_hash(tokens: jax.Array, count: jax.Array) -> u64.U64:
    """[N] hash of each row's last `count` of `tokens` [N, MAX_NGRAM_LEN - 1] (right-aligned)
    from the start value 1: accumulate_hash(1, context)."""
    n = tokens.shape[1]
    one = u64.const(1)
    h0 = (jnp.broadcast_to(one[0], count.shape), jnp.broadcast_to(one[1], count.shape))

    def step(i, h):
        nxt = accumulate(h, u64.from_u32(jax.lax.dynamic_index_in_dim(tokens, i, 1, False)))
        use = i >= n - count
        return jnp.where(use, nxt[0], h[0]), jnp.where(use, nxt[1], h[1])

    return jax.lax.fori_loop(0, n, step, h0)


def g_values(
    h: u64.U64,  # [...] the n-gram hashes
    keys: tuple[jax.Array, jax.Array],  # [..., D] (hi, lo) of the keys
    table: jax.Array,  # [..., S] u8
) -> jax.Array:  # [..., D] i32 in {0, 1}
    """The g-value of each hash under each key: table[accumulate(h, key) mod S]."""
    hk = accumulate((h[0][..., None], h[1][..., None]), keys)
    idx = u64.floor_mod(hk, table.shape[-1])  # [..., D]
    flat = idx.reshape(idx.shape[0], -1)
    return jnp.take_along_axis(table, flat, axis=-1).reshape(idx.shape).astype(jnp.int32)


def tournament(scores: jax.Array, g: jax.Array) -> jax.Array:
    """[B, V] scores and [B, V, D] g-values -> transformers' `update_scores`."""
    probs = jax.nn.softmax(scores, axis=1)

    def match(d, probs):
        gd = jax.lax.dynamic_index_in_dim(g, d, 2, False).astype(jnp.float32)
        mass = jnp.sum(gd * probs, axis=1, keepdims=True)
        return probs * (1 + gd - mass)

    probs = jax.lax.fori_loop(0, g.shape[2], match, probs)
    logp = jnp.log(probs)
    return jnp.where(jnp.isfinite(logp), logp, jnp.finfo(jnp.float32).min)


@struct.dataclass
class SynthIDState:
    """The row's last `context_history_size` context hashes (a ring; zeros at first, as
    transformers' history starts) and how many it pushed."""

    hashes_hi: jax.Array  # [B, H] u32
    hashes_lo: jax.Array  # [B, H] u32
    pushed: jax.Array  # [B] i32


@struct.dataclass
class SynthIDWatermark:
    """SynthID Text per row (see the module docstring). Build with `create`.

    It runs last (`after_filters`), after temperature, top-k, top-p and min-p, as
    transformers runs it after every warper: it sees the filtered-out tokens at -inf.
    """

    on: jax.Array  # [B] bool: the row is watermarked (keys not None)
    keys_hi: jax.Array  # [B, D] u32: the keys' int64 bits, high word
    keys_lo: jax.Array  # [B, D] u32
    ngram_len: jax.Array  # [B] i32 in [2, MAX_NGRAM_LEN]
    table: jax.Array  # [B, S] u8: randint(0, 2, (S,)) from the row's sampling_table_seed
    skip_first: jax.Array  # [B] bool: skip_first_ngram_calls
    history_size: int = struct.field(pytree_node=False, default=1024)

    after_filters: ClassVar[bool] = True

    @classmethod
    def create(
        cls,
        batch_size: int,
        *,
        keys: Any,
        ngram_len: Any = 5,
        sampling_table_seed: Any = 0,
        sampling_table_size: int = 2**16,
        context_history_size: int = 1024,
        skip_first_ngram_calls: Any = False,
    ) -> SynthIDWatermark:
        """keys: one list of int64 keys for every row, or one list (or None: no watermark
        on that row) per row; every list has the same length (the depth). ngram_len: int
        in [2, 32]. sampling_table_seed: int64. skip_first_ngram_calls: bool. These may
        differ per row (a list); sampling_table_size (in [2, 2^24]) and
        context_history_size (>= 1) are one value for the batch (they are shapes).

        Raises ValueError naming the argument, the row and the allowed range.
        """
        b = check_batch_size(batch_size)
        rows = _key_rows(keys, b)
        depth = {len(k) for k in rows if k is not None}
        n = _check_range(
            "ngram_len", _per_row("ngram_len", ngram_len, b), 2, MAX_NGRAM_LEN, integer=True
        )
        seeds = _check_range(
            "sampling_table_seed", _per_row("sampling_table_seed", sampling_table_seed, b),
            *_INT64, integer=True,
        )  # fmt: skip
        size = int(
            _check_range(
                "sampling_table_size", [sampling_table_size], 2, MAX_TABLE_SIZE, integer=True
            )[0]
        )
        hist = int(
            _check_range("context_history_size", [context_history_size], 1, 2**20, integer=True)[0]
        )
        skip = _per_row("skip_first_ngram_calls", skip_first_ngram_calls, b)
        for r, s in enumerate(skip):
            if not isinstance(s, (bool, np.bool_)):
                raise ValueError(
                    f"{row_name('skip_first_ngram_calls', r, b)} = {s!r} is not a bool"
                )
        (d,) = depth
        bits = np.zeros((b, d), np.uint64)
        for r, k in enumerate(rows):
            if k is not None:
                bits[r] = [x & ((1 << 64) - 1) for x in k]
        return cls(
            on=jnp.asarray([k is not None for k in rows], bool),
            keys_hi=jnp.asarray((bits >> np.uint64(32)).astype(np.uint32)),
            keys_lo=jnp.asarray((bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
            ngram_len=jnp.asarray(n, jnp.int32),
            table=jnp.asarray(np.stack([_table(int(s), size) for s in seeds])),
            skip_first=jnp.asarray(skip, bool),
            history_size=hist,
        )

    @property
    def depth(self) -> int:
        return self.keys_hi.shape[1]

    def init(self, batch_size: int, vocab_size: int) -> SynthIDState:
        zeros = jnp.zeros((batch_size, self.history_size), jnp.uint32)
        return SynthIDState(zeros, zeros, jnp.zeros((batch_size,), jnp.int32))

    def _context(self, step: Step) -> tuple[u64.U64, jax.Array]:
        """The row's context hash and whether this step is watermarked at all."""
        history = require_history(step, "SynthIDWatermark")
        w = MAX_NGRAM_LEN - 1
        generated = history.length - history.num_prompt  # [B]
        col = history.length[:, None] + jnp.arange(-w, 0)[None, :]  # [B, W]
        before = col < history.num_prompt[:, None]  # zeros stand in before the first token
        tok = jnp.take_along_axis(history.tokens, jnp.maximum(col, 0), axis=1)
        tok = jnp.where(before, 0, tok)
        h = context_hash(tok, self.ngram_len - 1)
        skipped = self.skip_first & (generated + 1 < self.ngram_len)
        return h, self.on & ~skipped

    def apply(self, state: SynthIDState, logits: jax.Array, step: Step) -> jax.Array:
        batch, vocab = logits.shape
        h, live = self._context(step)
        t = u64.from_u32(jnp.arange(vocab, dtype=jnp.uint32)[None, :])
        ht = accumulate((h[0][:, None], h[1][:, None]), t)  # [B, V]
        keys = (self.keys_hi[:, None, :], self.keys_lo[:, None, :])  # [B, 1, D]
        g = g_values(ht, keys, self.table)  # [B, V, D]
        seen = (state.hashes_hi == h[0][:, None]) & (state.hashes_lo == h[1][:, None])
        watermark = live & ~jnp.any(seen, axis=1)
        return jnp.where(watermark[:, None], tournament(logits, g), logits)

    def update(self, state: SynthIDState, tokens: jax.Array, step: Step) -> SynthIDState:
        h, live = self._context(step)
        slot = state.pushed % self.history_size
        put = (jnp.arange(self.history_size)[None, :] == slot[:, None]) & live[:, None]
        return SynthIDState(
            hashes_hi=jnp.where(put, h[0][:, None], state.hashes_hi),
            hashes_lo=jnp.where(put, h[1][:, None], state.hashes_lo),
            pushed=state.pushed + live.astype(jnp.int32),
        )


def _key_rows(keys: Any, batch: int) -> list[list[int] | None]:
    """One key list for every row, or one list (or None) per row; ints in int64."""
    if not isinstance(keys, (list, tuple, np.ndarray)):
        raise ValueError(f"keys must be a list of ints or one list (or None) per row, got {keys!r}")
    keys = list(keys)
    per_row = any(k is None or isinstance(k, (list, tuple, np.ndarray)) for k in keys)
    rows = keys if per_row else [keys] * batch
    if per_row and len(rows) != batch:
        raise ValueError(f"keys has {len(rows)} per-row lists but batch_size is {batch}")
    out = []
    for r, k in enumerate(rows):
        if k is None:
            out.append(None)
            continue
        name = row_name("keys", r, batch)
        k = list(k)
        if not k:
            raise ValueError(f"{name} is empty: the depth is at least 1 key")
        _check_range(name, k, *_INT64, integer=True, where=name)
        out.append([int(x) for x in k])
    if all(k is None for k in out):
        raise ValueError("keys: every row is None (no watermark): give at least one row keys")
    depth = next(len(k) for k in out if k is not None)
    for r, k in enumerate(out):
        if k is not None and len(k) != depth:
            raise ValueError(
                f"{row_name('keys', r, batch)} has {len(k)} keys but the batch's depth is "
                f"{depth}: every row needs a key set of the same size"
            )
    return out


@functools.lru_cache(maxsize=16)
def _table(seed: int, size: int) -> np.ndarray:
    return np.asarray(coin_table(seed, size))
