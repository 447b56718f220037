"""Fused truncation (top-k, top-p, min-p) and draw as one Pallas GPU kernel.

One program per row walks the row in blocks of `block` lanes; every step is a reduction
(max, count, masked sum, argmax), because sort and top-k do not lower in Pallas GPU.
Per row, with m = max(x):

  1. one pass: m, the lowest index of m (the greedy token), and the row's smallest and
     largest sortable keys (`xla.sortable_key`), which bracket every threshold;
  2. top-k (when on): the largest key K with count(key >= K) >= k, a multi-pivot search:
     each pass evaluates `num_pivots` evenly spaced pivots in the bracket at once and keeps
     the sub-interval where the count crosses k, so the bracket of 2^32 keys closes in
     ceil(32 / log2(num_pivots + 1)) passes (8 for 16 pivots; `num_pivots=1` is bisection);
  3. top-p (when on): one pass for the mass of the top-k survivors, then the same search on
     masses `sum(exp(x - m), x >= t_k, key >= K)` against p * that mass;
  4. min-p: t_m = m + log(min_p), no pass;
  5. one pass over the kept set x >= max(t_k, t_p, t_m): the normaliser and the exponential
     race `argmax (x_i - m) - log E_i`, with E_i hashed in-kernel from (row key, token id)
     by `noise.py`, so the token is the XLA path's token for token.

Greedy rows skip 2-5: their token is the lowest index of the row maximum, their kept set
is {x >= m} (reported as `Thresholds.top_k == row_max`, the other filters -inf) and their
`log_norm` is m (probability one).

The kernel reads the row with unmasked loads only: the last block of a row whose length is
not a multiple of `block` is read ending at the row's end and the lanes the previous block
already covered are masked out, so no load leaves the row. The GPU backend is picked in one
place, `COMPILER_PARAMS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from logitloop.ops.sampling import noise
from logitloop.ops.sampling.xla import Draw, Thresholds, key_to_float, sortable_key

BLOCK = 1024
NUM_PIVOTS = 16
NEG_INF = float("-inf")

# The Pallas GPU backend, chosen here and nowhere else: Triton. It lowers for CUDA from a
# CPU-only jaxlib (to XLA's `__gpu$xla.gpu.triton` custom call, compiled with the rest of
# the program), and XLA's compile-only CUDA client turns it into sm_90 code without a GPU
# (tests/ops). Without compiler params jax 0.10 picks Mosaic GPU, whose `pallas_call` path
# is deprecated and whose blocks are TMA copies into shared memory (<= 256 per dimension),
# not this kernel's loop over a row in global memory. Triton is deprecated from jax 0.11;
# moving to Mosaic GPU means `plgpu.kernel` with explicit SMEM staging, not a new constant.
COMPILER_PARAMS = pltriton.CompilerParams(num_warps=4)


def _fold_row(x_ref, fn, init, *, block: int, run=True):
    """Fold `fn(carry, x, ids, valid)` over the row in blocks of `block` lanes.

    x: [block] f32; ids: [block] i32 token ids; valid: [block] bool, False on lanes an
    earlier block already covered (only in the last block, which is read ending at the
    row's end so that no load goes past it). `run`: [] bool, False returns `init` without
    reading the row.
    """
    vocab = x_ref.shape[0]
    num_blocks = pl.cdiv(vocab, block)

    def body(b, carry):
        start = b * block
        read_at = jnp.minimum(start, vocab - block)
        ids = read_at + jax.lax.iota(jnp.int32, block)
        x = x_ref[pl.ds(read_at, block)]
        return fn(carry, x, ids, ids >= start)

    if run is True:
        return jax.lax.fori_loop(0, num_blocks, body, init)
    # Not `fori_loop` with a dynamic trip count (Triton rejects the `scf.for` it lowers to)
    # nor `cond` (its Triton lowering cannot return constants): a plain while loop.
    _, out = jax.lax.while_loop(
        lambda bc: run & (bc[0] < num_blocks), lambda bc: (bc[0] + 1, body(*bc)), (0, init)
    )
    return out


def _largest_threshold(x_ref, stat_fn, target, lo, hi, run, *, block: int, num_pivots: int):
    """Largest key K in [lo, hi] with stat(key >= K) >= target; lo when not `run`.

    stat_fn(x [block], ge [block, P] bool, valid [block]) -> [P], the block's share of the
    statistic at each of P pivots; summed over blocks it must be non-decreasing in the mask.
    Requires stat(key >= lo) >= target. lo, hi: [] u32; returns [] u32.
    """
    piece = jax.lax.iota(jnp.uint32, num_pivots) + jnp.uint32(1)  # [P]

    def search(lohi):
        lo, hi = lohi
        width = hi - lo
        step = width // jnp.uint32(num_pivots + 1) + jnp.uint32(1)
        pivots = lo + jnp.minimum(piece * step, width)  # [P], increasing, all in (lo, hi]

        def add(acc, x, ids, valid):
            ge = sortable_key(x)[:, None] >= pivots[None, :]  # [block, P]
            return acc + stat_fn(x, ge, valid)

        stats = _fold_row(x_ref, add, jnp.zeros((num_pivots,), target.dtype), block=block)
        ok = stats >= target  # [P], True on a prefix
        new_lo = jnp.max(jnp.where(ok, pivots, lo))
        new_hi = jnp.min(jnp.where(ok, hi, pivots - jnp.uint32(1)))
        return new_lo, new_hi

    lo, _ = jax.lax.while_loop(lambda lohi: run & (lohi[0] < lohi[1]), search, (lo, hi))
    return lo


def _sample_kernel(
    x_ref,  # [V] f32, scaled logits of one row
    top_k_ref,  # [] i32
    top_p_ref,  # [] f32
    min_p_ref,  # [] f32
    greedy_ref,  # [] i32, nonzero: greedy
    key_ref,  # [2] u32
    token_ref,  # [] i32 out
    log_mass_ref,  # [] f32 out, log sum over kept of exp(x - m)
    row_max_ref,  # [] f32 out
    t_k_ref,  # [] f32 out
    t_p_ref,  # [] f32 out
    t_m_ref,  # [] f32 out
    *,
    block: int,
    num_pivots: int,
):
    vocab = x_ref.shape[0]
    search = functools.partial(_largest_threshold, x_ref, block=block, num_pivots=num_pivots)
    fold = functools.partial(_fold_row, x_ref, block=block)

    # 1. max, greedy token, key bracket.
    def stats(carry, x, ids, valid):
        row_max, arg, kmin, kmax = carry
        x = jnp.where(valid, x, NEG_INF)
        keys = sortable_key(x)
        b_max = jnp.max(x)
        b_arg = jnp.min(ids) + jnp.argmax(x).astype(jnp.int32)
        arg = jnp.where(b_max > row_max, b_arg, arg)
        kmin = jnp.minimum(kmin, jnp.min(jnp.where(valid, keys, jnp.uint32(2**32 - 1))))
        return jnp.maximum(row_max, b_max), arg, kmin, jnp.maximum(kmax, jnp.max(keys))

    init = (jnp.float32(NEG_INF), jnp.int32(0), jnp.uint32(2**32 - 1), jnp.uint32(0))
    row_max, greedy_token, kmin, kmax = fold(stats, init)
    m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    greedy = greedy_ref[...] != 0

    # 2. top-k: the k-th largest value, ties kept.
    top_k = top_k_ref[...]
    k_on = (top_k > 0) & (top_k < vocab) & ~greedy

    def count(x, ge, valid):
        return jnp.sum((ge & valid[:, None]).astype(jnp.int32), axis=0)

    k_key = search(count, top_k, kmin, kmax, k_on)
    t_k = jnp.where(k_on, key_to_float(k_key), NEG_INF)

    # 3. top-p over the top-k survivors, renormalised.
    top_p = top_p_ref[...]
    p_on = (top_p < 1.0) & ~greedy

    def weights(x, valid):
        return jnp.where(valid & (x >= t_k), jnp.exp(x - m), 0.0)

    def mass(x, ge, valid):
        return jnp.sum(jnp.where(ge, weights(x, valid)[:, None], 0.0), axis=0)

    total = fold(
        lambda acc, x, ids, valid: acc + jnp.sum(weights(x, valid)), jnp.float32(0), run=p_on
    )
    # Nothing below t_k has mass, so t_p >= t_k: start the search there.
    p_key = search(mass, top_p * total, jnp.where(k_on, k_key, kmin), kmax, p_on)
    t_p = jnp.where(p_on, key_to_float(p_key), NEG_INF)

    # 4. min-p.
    min_p = min_p_ref[...]
    m_on = (min_p > 0) & ~greedy
    t_m = jnp.where(m_on, row_max + jnp.log(jnp.where(m_on, min_p, 1.0)), NEG_INF)

    # 5. normaliser and race over the kept set.
    kept = jnp.maximum(jnp.maximum(t_k, t_p), t_m)

    def race(carry, x, ids, valid):
        norm, best, token = carry
        log_w = jnp.where(valid & (x >= kept), x - m, NEG_INF)
        e = noise.exponential_from_bits(noise.counter_bits(key_ref, ids))
        score = jnp.where(log_w > NEG_INF, log_w - jnp.log(e), NEG_INF)
        b_best = jnp.max(score)
        b_token = jnp.min(ids) + jnp.argmax(score).astype(jnp.int32)
        token = jnp.where(b_best > best, b_token, token)
        return norm + jnp.sum(jnp.exp(log_w)), jnp.maximum(best, b_best), token

    norm, _, token = fold(race, (jnp.float32(0), jnp.float32(NEG_INF), jnp.int32(0)), run=~greedy)
    token = jnp.where(greedy, greedy_token, token)
    log_mass = jnp.where(greedy, 0.0, jnp.log(norm))

    token_ref[...] = token
    log_mass_ref[...] = log_mass
    row_max_ref[...] = row_max
    t_k_ref[...] = jnp.where(greedy, row_max, t_k)
    t_p_ref[...] = t_p
    t_m_ref[...] = t_m


def _block_size(vocab: int, block: int) -> int:
    """`block`, or the largest power of two that fits a shorter row."""
    return min(block, 1 << (vocab.bit_length() - 1))


def filter_and_sample_row(
    x: jax.Array,  # [V] f32
    top_k: jax.Array,  # [] i32
    top_p: jax.Array,  # [] f32
    min_p: jax.Array,  # [] f32
    greedy: jax.Array,  # [] i32
    key: jax.Array,  # [2] u32
    *,
    block: int = BLOCK,
    num_pivots: int = NUM_PIVOTS,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """One row: (token, log_mass, row_max, t_k, t_p, t_m), each []. Batch with `jax.vmap`.

    log_mass is log(sum over the kept set of exp(x - m)) with m the row maximum (0 when
    not finite), 0 on greedy rows.
    """
    kernel = functools.partial(
        _sample_kernel, block=_block_size(x.shape[0], block), num_pivots=num_pivots
    )
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    return pl.pallas_call(
        kernel,
        out_shape=(scalar(jnp.int32),) + (scalar(jnp.float32),) * 5,
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
        name="filter_and_sample",
    )(x, top_k, top_p, min_p, greedy, key)


@functools.partial(jax.jit, static_argnames=("block", "num_pivots", "interpret"))
def filter_and_sample_pallas(
    x: jax.Array,  # [B, V] f32, scaled logits; NaN-free
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
    *,
    block: int = BLOCK,
    num_pivots: int = NUM_PIVOTS,
    interpret: bool = False,
) -> tuple[Draw, Thresholds]:
    """Truncate each row by its own top-k/top-p/min-p and draw one token (Pallas kernel).

    Same contract as `xla.filter_and_sample`, except on greedy rows, where the filters are
    not evaluated: `Thresholds.top_k` is the row maximum, the others -inf, and `log_norm`
    is the row maximum. `block` (lanes per step) and `num_pivots` (pivots per search pass)
    are powers of two, as Triton's tensor shapes must be; neither changes the result.
    """
    for name, value in (("block", block), ("num_pivots", num_pivots)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} = {value} is not a power of two")
    row = functools.partial(
        filter_and_sample_row, block=block, num_pivots=num_pivots, interpret=interpret
    )
    token, log_mass, row_max, t_k, t_p, t_m = jax.vmap(row)(
        x.astype(jnp.float32),
        top_k.astype(jnp.int32),
        top_p.astype(jnp.float32),
        min_p.astype(jnp.float32),
        greedy.astype(jnp.int32),
        key.astype(jnp.uint32),
    )
    m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    x_tok = jnp.take_along_axis(x, token[:, None], axis=1)[:, 0]
    # (x_tok - m) - log_mass, not x_tok - log_norm: exact for logits far from zero.
    logprobs = jnp.where(greedy, 0.0, (x_tok - m) - log_mass)
    draw = Draw(tokens=token, logprobs=logprobs, log_norm=log_mass + m)
    return draw, Thresholds(row_max=row_max, top_k=t_k, top_p=t_p, min_p=t_m)
