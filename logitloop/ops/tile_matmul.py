"""A matrix product whose every row is computed by one fixed program: `deterministic=True`'s
products on a GPU, as a Pallas (Triton) kernel.

A GPU library picks its kernel for `[M, K] x [K, N]` by the shapes (and XLA's autotuner by
timing, program by program), and with it the split of the contraction and the order of the
partial sums, so a row's bits change with the number of rows it is batched with. Here the
grid runs over blocks of BLOCK_M rows and BLOCK_N columns, and every program sums the
contraction in blocks of BLOCK_K entries, one after another from entry 0, each block one
`[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]` dot into a float32 accumulator. Every output
entry is then produced by the same instructions in the same order whatever M is, whatever
the row's place in its block and whatever the other rows hold: M only changes the number of
row blocks. Zero padding (rows up to BLOCK_M, columns up to BLOCK_N, the contraction up to
BLOCK_K) adds exact zeros. N and K fix the column blocks and the contraction blocks, so a
row's bits are pinned per weight shape, which the model's config fixes.

`w_transposed=True` takes the weight as `[N, K]` (the LM head's `[V, E]` table, read as it
is stored). On a CPU the kernel runs in interpret mode (`interpret=True`), where each block
dot is one XLA:CPU dot of a fixed shape, which keeps a row's bits whatever the other rows
of the block hold (`tests/ops/test_tile_matmul.py`); it lowers for CUDA from a CPU-only
jaxlib like the sampling kernel (`logitloop.ops.sampling.pallas`, whose Triton backend
choice it shares).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from logitloop.ops.sampling.pallas import COMPILER_PARAMS

BLOCK_M = 16  # rows per program (Triton's dot takes at least 16 in each dimension)
BLOCK_N = 64  # columns per program
BLOCK_K = 32  # contraction entries per block dot


def _kernel(x_ref, w_ref, o_ref, *, blocks: int, w_transposed: bool):
    """One program: `o = x @ w` for its BLOCK_M x BLOCK_N block, the contraction summed
    block after block from entry 0 into float32."""
    dims = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))

    def add_block(b, acc):
        ks = pl.ds(b * BLOCK_K, BLOCK_K)
        w = w_ref[:, ks] if w_transposed else w_ref[ks, :]
        return acc + jax.lax.dot_general(x_ref[:, ks], w, dims, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, blocks, add_block, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("w_transposed", "out_dtype", "interpret"))
def tile_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    w_transposed: bool = False,
    out_dtype: jnp.dtype | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`x @ w` (`x @ w.T` with `w_transposed`), `[M, K]` by `[K, N]` (or `[N, K]`) ->
    `[M, N]` in `out_dtype` (default: x's dtype), accumulated in float32 in a fixed order
    (the module docstring). x and w share a dtype."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"tile_matmul takes 2-d arrays, got x {x.shape} and w {w.shape}")
    m, k = x.shape
    n, wk = w.shape if w_transposed else w.shape[::-1]
    if wk != k:
        side = "columns" if w_transposed else "rows"
        raise ValueError(f"x has {k} columns but w {side} {wk}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    mp, np_, kp = (-(-a // b) * b for a, b in ((m, BLOCK_M), (n, BLOCK_N), (k, BLOCK_K)))
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if w_transposed:
        w = jnp.pad(w, ((0, np_ - n), (0, kp - k)))
        w_spec = pl.BlockSpec((BLOCK_N, kp), lambda i, j: (j, 0))
    else:
        w = jnp.pad(w, ((0, kp - k), (0, np_ - n)))
        w_spec = pl.BlockSpec((kp, BLOCK_N), lambda i, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_kernel, blocks=kp // BLOCK_K, w_transposed=w_transposed),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // BLOCK_M, np_ // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, kp), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
        name="tile_matmul",
    )(x, w)
    return out[:m, :n]
