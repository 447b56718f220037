"""Kirchenbauer et al.'s green-list watermark, as transformers' `WatermarkLogitsProcessor`.

At each step a row's vocabulary is split by a keyed pseudo-random permutation: its first
`int(V * gamma)` tokens are "green", and every green token's logit gets `+delta`. A text
whose share of green tokens is far above `gamma` was (very likely) written with the key
(`logitloop.processors.watermark.detect`). The permutation is the one transformers draws
(`torch.randperm(V)` after `manual_seed(seed)` on the CPU generator, `torch_random`), so
text watermarked here is detected by transformers' `WatermarkDetector` and back. The seed:

- "lefthash" (the paper's Algorithm 2): `key * t` with `t` the row's last token.
- "selfhash" (Algorithm 3): for a candidate token `c`, the minimum over the window `w` of
  the row's last `context_width - 1` tokens and `c` of `key * (T[w] + 1) * (T[c] + 1)`,
  int64 arithmetic wrapping as in torch, where `T = randperm(1_000_003)` seeded with the
  key; `c` is green if it is in its own greenlist. As transformers, only the row's 40
  highest-scoring candidates are tried.

A row with fewer than `context_width` tokens (prompt included) is left alone, as
transformers skips a step whose `input_ids` are that short. The row's tokens are its own
(a batch's left padding is never read), so rows equal transformers' unpadded ones.
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
from logitloop.processors.watermark.torch_random import in_prefix, randperm_prefix

SEEDINGS = ("lefthash", "selfhash")
TABLE_SIZE = 1_000_003  # transformers' `table_size` for selfhash
NUM_CANDIDATES = 40  # selfhash tries this many of the best tokens (transformers' loop)
MAX_CONTEXT_WIDTH = 64  # selfhash's window is read through a static slice this wide
DEFAULT_KEY = 15485863  # transformers' default `hashing_key`


def lefthash_seed(key: jax.Array, last: jax.Array) -> jax.Array:
    """[N] u32: the low 32 bits of `key * last` (below 2^63, so no modulo applies)."""
    return key.astype(jnp.uint32) * last.astype(jnp.uint32)


def selfhash_seed(
    key: jax.Array,  # [N] u32
    window: jax.Array,  # [N, W] u32: T[w] + 1 for the window's tokens before the candidate
    valid: jax.Array,  # [N, W] bool
    own: jax.Array,  # [N] u32: T[c] + 1 for the candidate
) -> jax.Array:  # [N] u32
    """The seed transformers' `set_seed` computes for "selfhash", as `manual_seed` reads it."""
    parts = jnp.concatenate([window, own[:, None]], axis=1)  # [N, W + 1]
    k = key.astype(jnp.uint32)[:, None]
    kx = (u64.mul_hi(k, parts), k * parts)  # key * (T + 1), exact: both are below 2^32
    prod = u64.mul(kx, u64.from_u32(jnp.broadcast_to(own[:, None], parts.shape)))
    ok = jnp.concatenate([valid, jnp.ones_like(valid[:, :1])], axis=1)
    # The signed minimum: flip the sign bit to order as unsigned, then hi before lo.
    hi = jnp.where(ok, prod[0] ^ jnp.uint32(2**31), jnp.uint32(2**32 - 1))
    lo = jnp.where(ok, prod[1], jnp.uint32(2**32 - 1))
    best_hi = jnp.min(hi, axis=1)
    best_lo = jnp.min(jnp.where(hi == best_hi[:, None], lo, jnp.uint32(2**32 - 1)), axis=1)
    # `seed % (2**64 - 1)` in Python, then the low 32 bits: a negative seed gains 2^64 - 1.
    negative = best_hi < jnp.uint32(2**31)
    return jnp.where(negative, best_lo - jnp.uint32(1), best_lo)


def fixed_table(key: jax.Array, vocab_size: int) -> jax.Array:
    """[N, V] i32: the first V entries of transformers' `fixed_table` for each key (the
    only ones a token id below V reads)."""
    return randperm_prefix(key, TABLE_SIZE, vocab_size)


def fixed_tables(key: jax.Array, on: jax.Array, vocab_size: int) -> jax.Array:
    """`fixed_table` where some row in `on` needs it, else zeros (lefthash never reads it)."""
    return jax.lax.cond(
        jnp.any(on),
        lambda: fixed_table(key, vocab_size),
        lambda: jnp.zeros((key.shape[0], vocab_size), jnp.int32),
    )


@struct.dataclass
class GreenListWatermark:
    """Kirchenbauer et al.'s green-list watermark per row (transformers'
    `WatermarkLogitsProcessor`; see the module docstring). Build with `create`.

    It runs last (`after_filters`), after temperature, top-k, top-p and min-p, as
    transformers runs it after every warper: it sees the filtered-out tokens at -inf.
    """

    on: jax.Array  # [B] bool: the row is watermarked (key not None)
    key: jax.Array  # [B] u32: transformers' `hashing_key`
    green_size: jax.Array  # [B] i32: int(V * gamma), the greenlist's size
    gamma: jax.Array  # [B] f32: transformers' `greenlist_ratio` (the detector's expectation)
    delta: jax.Array  # [B] f32 >= 0: transformers' `bias`
    selfhash: jax.Array  # [B] bool: seeding "selfhash" (else "lefthash")
    context_width: jax.Array  # [B] i32 in [1, MAX_CONTEXT_WIDTH]
    vocab_size: int = struct.field(pytree_node=False, default=0)

    after_filters: ClassVar[bool] = True

    @classmethod
    def create(
        cls,
        batch_size: int,
        vocab_size: int,
        *,
        key: Any = DEFAULT_KEY,
        gamma: Any = 0.25,
        delta: Any = 2.0,
        seeding: Any = "lefthash",
        context_width: Any = 1,
    ) -> GreenListWatermark:
        """Per row (a scalar applies to every row, a list gives one value per row):

        key: int in [0, 2^32 - 1] (transformers' `hashing_key`), or None: no watermark on
        that row. gamma: in (0, 1), the green share (`greenlist_ratio`). delta: >= 0, the
        bias added to green logits. seeding: "lefthash" or "selfhash". context_width: int in
        [1, 64]. vocab_size: the model's (the logits' width; transformers' `vocab_size`).

        Raises ValueError naming the argument, the row and the allowed range.
        """
        b = check_batch_size(batch_size)
        if not isinstance(vocab_size, (int, np.integer)) or not 2 <= vocab_size <= TABLE_SIZE:
            raise ValueError(
                f"vocab_size = {vocab_size!r} is outside the allowed range [2, {TABLE_SIZE}]"
            )
        keys = _per_row("key", key, b)
        on = [k is not None for k in keys]
        keys = [0 if k is None else k for k in keys]
        keys = _check_range("key", keys, 0, 2**32 - 1, integer=True)
        g = _check_range("gamma", _per_row("gamma", gamma, b), 0, 1, lo_open=True, hi_open=True)
        d = _check_range("delta", _per_row("delta", delta, b), 0, float("inf"))
        width = _check_range(
            "context_width", _per_row("context_width", context_width, b), 1, MAX_CONTEXT_WIDTH,
            integer=True,
        )  # fmt: skip
        schemes = _per_row("seeding", seeding, b)
        for r, s in enumerate(schemes):
            if s not in SEEDINGS:
                raise ValueError(f"{row_name('seeding', r, b)} = {s!r} is not one of {SEEDINGS}")
        return cls(
            on=jnp.asarray(on, bool),
            key=jnp.asarray(keys.astype(np.uint32)),
            green_size=jnp.asarray([int(vocab_size * float(x)) for x in g], jnp.int32),
            gamma=jnp.asarray(g, jnp.float32),
            delta=jnp.asarray(d, jnp.float32),
            selfhash=jnp.asarray([s == "selfhash" for s in schemes], bool),
            context_width=jnp.asarray(width, jnp.int32),
            vocab_size=int(vocab_size),
        )

    def init(self, batch_size: int, vocab_size: int) -> jax.Array:
        """[B, V] i32: each selfhash row's fixed table (drawn once; it depends on the key)."""
        return fixed_tables(self.key, self.on & self.selfhash, vocab_size)

    def apply(self, state: jax.Array, logits: jax.Array, step: Step) -> jax.Array:
        history = require_history(step, "GreenListWatermark")
        batch, vocab = logits.shape
        if vocab != self.vocab_size:
            raise ValueError(
                f"GreenListWatermark was created for vocab_size = {self.vocab_size}, but the "
                f"logits have V = {vocab}"
            )
        length = history.length
        ready = self.on & (length >= self.context_width) & (length >= 1)
        last = jnp.take_along_axis(history.tokens, jnp.maximum(length - 1, 0)[:, None], axis=1)
        lefthash = ready & ~self.selfhash
        selfhash = ready & self.selfhash
        zero = jnp.zeros_like(logits)
        bias = jax.lax.cond(
            jnp.any(lefthash),
            lambda: _lefthash_bias(self, last[:, 0], vocab) * lefthash[:, None],
            lambda: zero,
        )
        bias = bias + jax.lax.cond(
            jnp.any(selfhash),
            lambda: _selfhash_bias(self, state, logits, history) * selfhash[:, None],
            lambda: zero,
        )
        return jnp.where(ready[:, None], logits + bias, logits)

    def update(self, state: jax.Array, tokens: jax.Array, step: Step) -> jax.Array:
        return state


def _lefthash_bias(wm: GreenListWatermark, last: jax.Array, vocab: int) -> jax.Array:
    """[B, V] f32: delta on each row's greenlist seeded by its last token, 0 elsewhere."""
    perm = randperm_prefix(lefthash_seed(wm.key, last), vocab, vocab - 1)  # [B, V - 1]
    green = jnp.arange(vocab - 1)[None, :] < wm.green_size[:, None]
    rows = jnp.broadcast_to(jnp.arange(perm.shape[0])[:, None], perm.shape)
    cols = jnp.where(green, perm, vocab)  # -> dropped
    delta = jnp.broadcast_to(wm.delta[:, None], perm.shape)
    return jnp.zeros((perm.shape[0], vocab), jnp.float32).at[rows, cols].set(delta, mode="drop")


def window_parts(
    table: jax.Array,  # [N, V] i32, each row's fixed table
    tokens: jax.Array,  # [N, C] i32, each row's tokens
    end: jax.Array,  # [N] i32: the window ends before this column
    width: jax.Array,  # [N] i32: context_width (the window holds width - 1 tokens)
) -> tuple[jax.Array, jax.Array]:  # ([N, W] u32 T[w] + 1, [N, W] bool)
    """The selfhash window's `T[w] + 1` for the `width - 1` tokens before column `end`."""
    w = MAX_CONTEXT_WIDTH - 1
    offset = jnp.arange(w)[None, :] - w  # [1, W]: -W .. -1
    col = end[:, None] + offset
    valid = (offset >= -(width[:, None] - 1)) & (col >= 0)
    tok = jnp.take_along_axis(tokens, jnp.clip(col, 0, tokens.shape[1] - 1), axis=1)
    tok = jnp.clip(tok, 0, table.shape[1] - 1)
    part = jnp.take_along_axis(table, tok, axis=1).astype(jnp.uint32) + 1
    return part, valid


def _selfhash_bias(
    wm: GreenListWatermark, table: jax.Array, logits: jax.Array, history: Any
) -> jax.Array:
    """[B, V] f32: delta on each of the row's best candidates that is in its own greenlist."""
    batch, vocab = logits.shape
    num = min(NUM_CANDIDATES, vocab)
    _, cand = jax.lax.top_k(logits, num)  # [B, K]
    window, valid = window_parts(table, history.tokens, history.length, wm.context_width)
    own = jnp.take_along_axis(table, cand, axis=1).astype(jnp.uint32) + 1  # [B, K]

    def rep(x):  # [B, ...] -> [B * K, ...]
        return jnp.repeat(x, num, axis=0)

    seed = selfhash_seed(rep(wm.key), rep(window), rep(valid), own.reshape(-1))
    green = in_prefix(seed, cand.reshape(-1), rep(wm.green_size), vocab).reshape(batch, num)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], cand.shape)
    delta = jnp.broadcast_to(wm.delta[:, None], cand.shape)
    cols = jnp.where(green, cand, vocab)
    return jnp.zeros((batch, vocab), jnp.float32).at[rows, cols].set(delta, mode="drop")


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def green_flags(
    key: jax.Array,  # [N] u32
    selfhash: jax.Array,  # [N] bool
    context: jax.Array,  # [N, W + 1] i32: the n-gram, the scored token last, -1 = none
    green_size: jax.Array,  # [N] i32
    width: jax.Array,  # [N] i32 context_width
    *,
    vocab_size: int,
) -> jax.Array:  # [N] bool
    """Whether each n-gram's last token is green under its key (the detector's test): for
    "lefthash" the token before it seeds the greenlist, for "selfhash" the window ending in
    it, as transformers' `WatermarkDetector` scores an n-gram."""
    end = jnp.full(key.shape, context.shape[1] - 1, jnp.int32)
    target = context[:, -1]
    prev = context[:, -2]
    table = fixed_tables(key, selfhash, vocab_size)
    window, valid = window_parts(table, context, end, width)
    own = jnp.take_along_axis(table, target[:, None], axis=1)[:, 0].astype(jnp.uint32) + 1
    seed = jnp.where(
        selfhash, selfhash_seed(key, window, valid, own), lefthash_seed(key, jnp.maximum(prev, 0))
    )
    return in_prefix(seed, target, green_size, vocab_size)
