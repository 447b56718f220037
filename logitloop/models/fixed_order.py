"""Fixed-order reductions: what `deterministic=True` switches the model layers to.

A row's logits depend on the batch it runs in when a kernel's summation order depends on
the shapes it is given. On XLA:CPU a float32 product `[M, K] x [K, N]` rounds row 0
differently for M = 2..33 than for M = 1 or 64 (permuting rows, or changing the other
rows' contents at a fixed M, changes nothing), and attention sums over however many cache
slots the call reads. In this mode every reduction a row's logits go through has an order
fixed by the model's config alone, never by the batch size, the number of columns in the
call, the cache length or the mesh:

- Products over the hidden or MLP dimension (q/k/v/o projections, the MLP, the LM head;
  `layers.split_heads`, `merge_heads`, `dense`, `DecoderModel.__call__`) run over tiles of
  a fixed number of rows (`rowwise`): `lax.map` over `[M / tile, tile, K]`, M padded up
  with zero rows, so the one product XLA compiles always has `tile` rows. A row's result
  then does not depend on M, nor on its place in its tile, nor on its neighbours. The
  tile is fixed per pass, not per batch: PROMPT_TILE rows for the hidden states of a
  prompt pass, DECODE_TILE for a decode step, a speculative verification and every LM
  head. Prompt tokens only ever go through the prompt pass and generated tokens through
  decode steps or verification, in every batch, slot and chunking, so each position meets
  the same shapes. On XLA:CPU's YNNPACK dots, whose rows keep their bits for any row count
  from 2 to 32, a decode-pass product runs its rows unpadded up to DECODE_TILE (one row as
  two), which spares batch 1 the work of eight rows (`row_tile`).
  On a mesh with a "data" axis each device's rows are tiled by themselves
  (`Numerics.row_mesh`, from the decode loop's layout), so every device runs the
  one-device tile.
  On a GPU (`Numerics.tile_kernel`) the products are instead the Pallas tile kernel
  (`logitloop.ops.tile_matmul`: fixed row, column and contraction blocks, so a row's bits
  do not depend on the row count by construction), over the rows as they come: no row
  tiles, since a GPU library and XLA's autotuner choose a dot's kernel by its shape and by
  timing, program by program, which a fixed tile shape alone would not pin.
- With `deterministic="model-parallel"` (`Numerics.splits`), a product within a tile
  also sums its contraction in chunks of at most MAX_CHUNK entries at fixed boundaries,
  the chunks' float32 partial sums added one after another (`product`), and the LM head
  runs over a fixed number of vocabulary tiles (`head_product`). Chunks and tiles are laid
  out from the config alone so that a "model" axis of any size dividing MODEL_PARTS holds
  whole chunks or tiles: where the mesh splits a contraction (the output projection by
  heads, the down projection by the MLP axis), each device computes whole chunks' partial
  sums and the fixed-order sum replaces the all-reduce, whose order the mesh decides;
  where it splits the columns (q/k/v, gate/up, the vocabulary), each device's product of
  its own columns gives them the one-device bits (XLA:CPU's own product does, for a
  contraction of at most 128 whatever the number of columns; YNNPACK's dot, and XLA's own
  above ~150, do not). Without it the products are single dots: faster (YNNPACK's), and
  invariant to the batch and a data axis, not to a model axis.
- Attention runs `logitloop.ops.attention`'s "fixed-order" implementation
  (`fixed_order_attention`, re-exported here as `attention`): scores summed by halving
  over the head dimension, slots summed in chunks of `SLOT_CHUNK` at fixed absolute
  boundaries, the chunks added one after another from slot 0, so masked slots (past a
  row's last position, cache padding, a longer bucket or buffer) add exact zeros.
- Norms (RMSNorm, LayerNorm, QK-norm) take their means by halving over the row (`mean`).
  RoPE, activations, residual adds and the embedding are elementwise or gathers, the
  same for a row wherever it sits (with the library fusions off, below).

Keys and values are read from the cache, where slot == position, so chunked prefill and
one pass give the same sums. Sliding-window rings (`layers.ring_keys`) hold slots in
`position % R` order plus this call's columns, so for a layer with a ring the order is
fixed for a given call shape only (batch size and composition, not prefill chunking or
the bucket). The mixture-of-experts MLP (`moe.py`) runs its router and its dense mixture
over the pass's row tiles (`rowwise`): covered by `deterministic=True` with XLA's row
tiles; not by the GPU tile kernel (whose `rowwise` takes the rows as they come) nor by the
model-parallel splits (the experts' products are single einsums).

Fixed orders are not enough by themselves on XLA:CPU: above a size threshold it hands
fusions (a reduce, an `exp(x - max)`, elementwise code around a product) to YNNPACK
kernels, whose order and whose `exp` differ from XLA's own code, so the same row computed
in a bigger array comes out different. Programs of a deterministic runner are compiled
with those fusions off except YNNPACK's individual dots (`compiler_options`, applied by
`decoding.loop.runner.runner_jit`): a dot alone, of one fixed tile shape, gives each row the
same bits whatever the other rows and the program around it (tested), and it is faster
than XLA:CPU's own dot (BENCHMARKS.md, "Deterministic decoding"). A model-parallel
program has YNNPACK's dots off as well (`CPU_SPLIT_OPTIONS`): they round a column
differently with the number of columns.

The policy itself, `Numerics`, its tiles and its compiler options live in
`logitloop.models.numerics`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from logitloop.models import probe_record, quantization
from logitloop.models.numerics import (  # noqa: F401 - re-exported: the policy's names
    CPU_COMPILER_OPTIONS,
    CPU_SPLIT_OPTIONS,
    DECODE_TILE,
    EXACT_PRECISION_OPTIONS,
    MAX_CHUNK,
    MODEL_PARALLEL,
    MODEL_PARTS,
    PLAIN,
    PROMPT_TILE,
    TILE_KERNELS,
    Numerics,
    compiler_options,
)
from logitloop.models.partitioning import DATA_AXIS
from logitloop.ops.attention.fixed_order import SLOT_CHUNK, ordered_sum, tree_sum
from logitloop.ops.attention.fixed_order import fixed_order_attention as attention

__all__ = [
    "MODEL_PARALLEL", "PLAIN", "SLOT_CHUNK", "Numerics", "attention", "calibrate",
    "ordered_sum", "tree_sum",
]  # fmt: skip


def calibrate(
    deterministic: bool | str = False,
    *,
    dtype: jnp.dtype | str = jnp.float32,
    tile_kernel: str | None = "auto",
    backend: str | None = None,
    shapes: Iterable[tuple[bool, int, int]] = (),
) -> Numerics:
    """The numerics policy of a runner with this `deterministic=` setting and activations
    of `dtype` on `backend` (default: the default backend), probes run here, once per
    (setting, dtype, backend) in a process, their results kept on disk
    (`unpadded_rows_keep_bits`, `split_tiles_keep_row_bits`, `measure`: on XLA:CPU one
    program each, a few tenths of a second, and none once recorded).

    `shapes`: the model's decode products, `(head, K, N)` (`product_shapes`), measured
    here too, in one program, for the kinds whose rows may run unpadded, so that a decode
    pass's trace finds them known (one it does not find is measured then).

    `tile_kernel`: "auto" takes the Pallas tile kernel ("pallas") for `deterministic=True`
    on a GPU, where the libraries behind XLA's dots pick their kernel by the row count and
    its autotuner by timing, and XLA's dots in fixed row tiles (None) otherwise; None
    (or "off"), "pallas" or "interpret" (the kernel in Pallas' interpret mode, which runs
    anywhere: how the CPU tests run the GPU's path) choose it for `deterministic=True`."""
    if tile_kernel == "off":
        tile_kernel = None
    if tile_kernel != "auto" and tile_kernel is not None and tile_kernel not in TILE_KERNELS:
        raise ValueError(
            f"tile_kernel must be 'auto', 'off', None or one of {TILE_KERNELS}, got {tile_kernel!r}"
        )
    backend = backend or jax.default_backend()
    shapes = tuple(sorted({(bool(h), int(k), int(n)) for h, k, n in shapes}))
    return _calibrated(deterministic, jnp.dtype(dtype).name, tile_kernel, backend, shapes)


@functools.cache
def _calibrated(
    deterministic, dtype: str, tile_kernel: str | None, backend: str, shapes: tuple
) -> Numerics:
    Numerics(deterministic=deterministic)  # checks the setting before any probe runs
    if deterministic is not True:
        tile_kernel = None
    elif tile_kernel == "auto":
        tile_kernel = "pallas" if backend == "gpu" else None
    unpadded = frozenset()
    if deterministic is True and tile_kernel is None and backend == "cpu":
        # Both kinds' probes in one program, then the model's shapes of the kinds that passed.
        measure([(dtype, head, k, n) for head in (False, True) for k, n in _PROBE_SHAPES[head]])
        unpadded = frozenset(
            (dtype, head) for head in (False, True) if unpadded_rows_keep_bits(dtype, head)
        )
        measure([(dtype, head, k, n) for head, k, n in shapes if (dtype, head) in unpadded])
    split_bits = deterministic != MODEL_PARALLEL or split_tiles_keep_row_bits()
    return Numerics(
        deterministic=deterministic,
        tile_kernel=tile_kernel,
        unpadded=unpadded,
        split_rows_keep_bits=split_bits,
    )


def product_shapes(
    params: Iterable[Any], head: tuple[int, int] | None, head_dim: int | None = None
) -> tuple[tuple[bool, int, int], ...]:
    """The decode products a model's weights suggest, `(head, K, N)` for `calibrate`:
    every 2-D floating weight `[K, N]` (`layers.dense`'s operand) but the `[V, E]`
    vocabulary table `head`, whose product is the LM head's `(E, V)`; a 3-D one seen as
    `layers.split_heads` and `merge_heads` see it, `[E, H, head_dim]` as `(E, H * head_dim)`
    and `[H, head_dim, E]` as `(H * head_dim, E)`. A guess that only saves compiles: a
    product it misses is measured when the decode pass traces it, one it adds costs its
    share of one probe program (none larger than the LM head's is added)."""
    out = set()
    for p in params:
        shape, dtype = tuple(getattr(p, "shape", ())), getattr(p, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            continue
        if len(shape) == 2 and shape != tuple(head or ()):
            out.add(shape)
        elif len(shape) == 3 and head_dim is not None:
            a, b, c = shape
            if c == head_dim:
                out.add((a, b * c))
            if b == head_dim:
                out.add((a * b, c))
    limit = math.prod(head) if head is not None else math.inf
    found = {(False, k, n) for k, n in out if k * n <= limit}
    if head is not None:
        found.add((True, int(head[1]), int(head[0])))
    return tuple(sorted(found))


def row_tile(
    rows: int,
    numerics: Numerics,
    *,
    head: bool = False,
    dtype=jnp.float32,
    shape: tuple[int, int] | None = None,
) -> int:
    """Rows per product tile, for a product over `rows` rows (one device's) of `dtype` in
    the pass `numerics` describes (`head`: the LM head's product; `shape`: its `(K, N)`,
    `(E, V)` for the head, or None for a tile of several products): PROMPT_TILE for a
    prompt pass's hidden states; for a decode step, a verification and every LM head,
    DECODE_TILE, except where the policy's probe found that a row keeps its bits for
    2..DECODE_TILE rows (XLA:CPU's YNNPACK dots, no model-parallel splits) and the probe of
    this very shape agrees (`shape_keeps_row_bits`): the rows themselves, at least 2 and
    at most DECODE_TILE (see DECODE_TILE)."""
    if numerics.prompt and not head:
        return PROMPT_TILE
    name = jnp.dtype(dtype).name
    if (
        (name, head) not in numerics.unpadded
        or shape is None
        or not shape_keeps_row_bits(name, head, *shape)
    ):
        return DECODE_TILE
    return min(max(rows, 2), DECODE_TILE)


# (E, V) of the head probe and (K, N) of the product probe (the shipped model's sizes).
_PROBE_SHAPES = {True: ((64, 512), (256, 4096)), False: ((256, 704), (704, 256))}

# The probes' results in this process, (dtype name, head, K, N) -> whether a row keeps its
# bits (`measure`); `probe_record` keeps them on disk across processes.
_measured: dict[probe_record.Entry, bool] = {}
_measured_lock = threading.Lock()


def unpadded_rows_keep_bits(dtype: str, head: bool) -> bool:
    """Whether a row of a decode-pass product in `dtype` on XLA:CPU's YNNPACK dots (the
    compiler options of `deterministic=True`) has the same bits for every row count from 2
    to DECODE_TILE and every place among them (`head`: the LM head's `[M, E] x [V, E]^T`
    into float32; else `[M, K] x [K, N]` in `dtype`), probed at `_PROBE_SHAPES` (`measure`:
    once per machine; `calibrate` runs it). Where it does not, decode passes pad to
    DECODE_TILE rows (`row_tile`), whatever the shape."""
    return all(measure([(dtype, head, k, n) for k, n in _PROBE_SHAPES[head]]).values())


def shape_keeps_row_bits(dtype: str, head: bool, k: int, n: int) -> bool:
    """`unpadded_rows_keep_bits` for one product shape (`(K, N)`, or `(E, V)` with `head`),
    asked when a decode pass traces a product of that shape (`measure`; `calibrate` has
    measured the model's own shapes already). YNNPACK's float32 dots keep a row's bits for
    2..8 rows at most shapes, not at all: on the Xeons this was built on, not with N <= 8 (a
    mixture of experts' router over 8 experts) on one, nor N = 4097..4101 on both, where
    `x @ w` rounds a row otherwise with the row count (its `[V, E]^T` head form did not)."""
    return measure([(dtype, head, k, n)])[(dtype, head, k, n)]


def measure(entries: Iterable[probe_record.Entry]) -> dict[probe_record.Entry, bool]:
    """Whether a decode tile's rows keep their bits, for each `(dtype name, head, K, N)` of
    `entries` (`shape_keeps_row_bits`), each entry measured once per machine: known in this
    process, or recorded on disk by an earlier one for the same jax, jaxlib, backend, CPU,
    threads, XLA flags and options (`probe_record`), else probed, all those at once in one
    program (`_probe`), and recorded.

    Every shape is measured; none is inferred from another. The shapes where YNNPACK's dot
    rounds a row by the row count form no rule one could extend safely: the narrowest
    (N <= 8) on one Xeon and not on another (N = 8 keeps its bits on the 2-core Xeon of the
    December 2026 measurements), and a band of a few widths just above 4096 (4097..4101)
    between widths that keep them, by the dot's blocking, which depends on the CPU's vector
    width and the library's release. So a shape nobody measured on this machine is probed
    before its rows run unpadded; a probe costs one compile for all the shapes asked
    together (a few tenths of a second), and nothing in a process that finds them on disk."""
    entries = list(dict.fromkeys(entries))
    with _measured_lock:
        missing = [e for e in entries if e not in _measured]
        if missing:
            key = probe_record.machine_key(compiler_options())
            stored = probe_record.load(key)
            _measured.update({e: stored[e] for e in missing if e in stored})
            new = [e for e in missing if e not in _measured]
            if new:
                results = dict(zip(new, _probe(new), strict=True))
                _measured.update(results)
                probe_record.save(key, results)
        return {e: _measured[e] for e in entries}


def _probe(entries: Sequence[probe_record.Entry]) -> list[bool]:
    """For each `(dtype, head, K, N)`: whether row 0 of random `[DECODE_TILE, K]` rows
    times a random weight (`[K, N]` in `dtype`, or with `head` `[N, K]` transposed into
    float32) has the same bits at every place p among the first M rows for every M from 2
    to DECODE_TILE, all in one program of the deterministic options (`_rows_keep_bits`).
    Each entry draws its inputs from seed 0, so its answer does not depend on the entries
    probed beside it."""
    cases = []
    for dtype, head, k, n in entries:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((DECODE_TILE, k), np.float32)
        w = rng.standard_normal((n, k) if head else (k, n), np.float32)
        cases.append((_head_rows if head else _dot_rows, x.astype(dtype), w.astype(dtype), n))
    return _rows_keep_bits(cases, range(2, DECODE_TILE + 1))


def _dot_rows(x, w):
    return x @ w


def _head_rows(x, w):
    return jnp.einsum("be,ve->bv", x, w, preferred_element_type=jnp.float32)


def _rows_keep_bits(cases: list, counts: Sequence[int], model_parallel=False) -> list[bool]:
    """For each `(product, x, w, N)` of `cases` (x and w NumPy, `product(rows, w)` of N
    columns): whether row 0 of `x` comes out of `product` with the same bits at every place
    p among the first m rows of x (x's rows rolled by p), for every m in `counts`, as at
    place 0 among the first `counts[0]` rows. One program for all (`model_parallel`: its
    compiler options): per case and count, a `lax.map` over the m placements, so each
    product is its own dot of `[m, K]` rows, as a decode tile's is. The compiled program is
    checked to hold exactly those dots (XLA merging dots that share a weight would compute
    other row counts than the ones asked); where it does not, every case answers False
    (pad: always exact)."""

    def fn(args):
        return [
            tuple(jax.lax.map(lambda rows, w=w, f=f: f(rows, w), xs) for xs in placements)
            for (placements, w), (f, *_) in zip(args, cases, strict=True)
        ]

    args = [
        (tuple(np.stack([np.roll(x[:m], p, 0) for p in range(m)]) for m in counts), w)
        for _, x, w, _ in cases
    ]
    options = compiler_options(model_parallel)
    compiled = jax.jit(fn, compiler_options=options).lower(args).compile()
    expected = sorted((m, n) for *_, n in cases for m in counts)
    found = sorted((int(a), int(b)) for a, b in _DOT.findall(compiled.as_text()))
    if found != expected:
        warnings.warn(
            f"logitloop: the fixed-order probe's program holds dots {found}, not {expected}: "
            "decode tiles pad to DECODE_TILE rows",
            stacklevel=2,
        )
        return [False] * len(cases)
    keeps = []
    for per_count in compiled(args):  # one case: per count, [m placements, m rows, N]
        outs = [np.asarray(o, np.float32) for o in per_count]
        ref = outs[0][0, 0]
        keeps.append(all(np.array_equal(o[p, p], ref) for o in outs for p in range(len(o))))
    return keeps


# A dot instruction of a rank-2 result in optimized HLO text: `f32[3,4098]{1,0} dot(`.
_DOT = re.compile(r"\[(\d+),(\d+)\]\{[^}]*\} dot\(")


@functools.cache
def split_tiles_keep_row_bits() -> bool:
    """Whether the model-parallel mode's product on the default backend gives a row of a
    DECODE_TILE-row tile the same bits at every place in the tile (a probe of one small
    product, once per process). The mode's invariance rests on it: it holds on the Intel
    Xeon machines this was built on, and not on an AMD EPYC (AVX2), whose XLA:CPU (Eigen)
    product rounds rows 6 and 7 of 8 otherwise than rows 0-5. Off XLA:CPU: True (not
    probed; the mode makes no claim for other backends beyond its fixed tiles)."""
    if jax.default_backend() != "cpu":
        return True
    rng = np.random.default_rng(0)
    x = rng.standard_normal((DECODE_TILE, 32), np.float32)
    w = rng.standard_normal((32, 64), np.float32)
    (keeps,) = _rows_keep_bits([(_dot_rows, x, w, 64)], [DECODE_TILE], model_parallel=True)
    return keeps


def rowwise(
    fn: Callable[..., Any],
    x: jax.Array,
    *,
    numerics: Numerics,
    head: bool = False,
    aux: jax.Array | None = None,
    shape: tuple[int, int] | None = None,
) -> Any:
    """`fn(x)` for a row-wise `fn: [M, K] -> [M, N]`; under a fixed-order policy over
    tiles of `row_tile(rows, numerics, head=head)` rows (zero rows pad the last), so that
    every product XLA compiles in a given pass has one shape on every device, or (decode
    passes on YNNPACK's dots) a row count whose range gives a row the same bits.

    With the rows over a mesh's "data" axis of size D (`numerics.row_mesh`; the M rows in
    D contiguous blocks, one per device), each device's block is padded and tiled by
    itself: the tiles go through `lax.map` as `[D, tile, K]`, D over "data", so every
    device runs a `[tile, K]` product on its own rows, as one device does. (Tiling the
    global rows instead would let the partitioner split a tile's rows over the devices: on
    a (8, 1) mesh at batch 8 each device then ran one-row products, which round
    differently.)

    `aux`: a second `[M, ...]` array whose rows go with x's (an MoE layer's replayed
    experts): `fn(x_rows, aux_rows)`, tiled alike. `fn` may return a tuple of `[M, N_i]`
    arrays (the mixture and the experts it used); so does `rowwise` then.
    `shape`: `(K, N)` of `fn`'s one product (`(E, V)` for the head), whose probe decides
    whether a decode pass may take its rows unpadded (`row_tile`); None (a tile of several
    products, a mixture of experts' router and experts): decode tiles of DECODE_TILE."""
    args = (x,) if aux is None else (x, aux)
    if not numerics.fixed:
        return fn(*args)
    split = numerics.prompt_rows
    if split is not None and not head:
        # A packed pass: its prompt tokens tiled as a prompt pass's, the rest as a decode
        # step's (`Numerics.prompt_rows`), so each token meets its own pass's shapes.
        def part(first: bool) -> Any:
            def cut(a):
                return a[:split] if first else a[split:]

            policy = dataclasses.replace(numerics, prompt=first, prompt_rows=None)
            rest = {} if aux is None else {"aux": cut(aux)}
            return rowwise(fn, cut(x), numerics=policy, shape=shape, **rest)

        if split >= x.shape[0] or split <= 0:
            return part(split > 0)
        return jax.tree.map(lambda p, d: jnp.concatenate([p, d]), part(True), part(False))
    mesh = numerics.row_mesh
    if numerics.tile_kernel is not None and mesh is None:
        return fn(*args)  # the kernel's rows do not depend on the row count: no tiles needed
    d = mesh.shape[DATA_AXIS] if mesh is not None else 1
    m = x.shape[0]
    if m % d:
        raise ValueError(f"{m} rows do not split over a data axis of size {d}")
    per = m // d
    tile = row_tile(per, numerics, head=head, dtype=x.dtype, shape=shape)

    def to_tiles(a):  # [M, K] -> [T, D, tile, K], zero rows padding each device's block
        a = a.reshape(d, per, -1)
        a = jnp.pad(a, ((0, 0), (0, -per % tile), (0, 0)))
        a = a.reshape(d, -1, tile, a.shape[-1]).transpose(1, 0, 2, 3)
        if mesh is not None:
            spec = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))
            a = jax.lax.with_sharding_constraint(a, spec)
        return a

    def from_tiles(a):  # [T, D, tile, N] -> [M, N]
        a = a.transpose(1, 0, 2, 3).reshape(d, -1, a.shape[-1])[:, :per]  # [D, per, N]
        return a.reshape(m, a.shape[-1])

    def one_tile(ts):
        got = fn(*(t.reshape(d * tile, -1) for t in ts))
        return jax.tree.map(lambda o: o.reshape(d, tile, -1), got)

    out = jax.lax.map(one_tile, tuple(to_tiles(a) for a in args))
    return jax.tree.map(from_tiles, out)


def contraction_chunk(k: int, groups: int = 1) -> int:
    """Entries of the contraction per chunk in a fixed-order product over `k` entries
    that a model-parallel mesh may split into `groups` equal blocks (1: never split, as
    the embedding axis; the head count for the output projection; `k` for the MLP's down
    projection): the longest chunk of at most MAX_CHUNK that divides every device's share
    of `k` on a "model" axis of any size dividing MODEL_PARTS."""
    if groups < 1 or k % groups:
        raise ValueError(f"a contraction of {k} does not split into {groups} groups")
    base = k // math.gcd(groups, MODEL_PARTS)
    return max(c for c in range(1, min(base, MAX_CHUNK) + 1) if base % c == 0)


def product(rows: jax.Array, w: jax.Array, *, numerics: Numerics, groups: int = 1) -> jax.Array:
    """`rows @ w`, `[M, K] x [K, N] -> [M, N]` in `rows`' dtype; under a model-parallel
    policy (`numerics.splits`) the contraction runs in chunks of
    `contraction_chunk(K, groups)` entries at fixed boundaries: one batched product
    `[C, M, chunk] x [C, chunk, N]` (w's chunks are a free view of its rows) into float32
    partial sums, added chunk after chunk from 0.

    On a mesh that splits the contraction over its "model" axis (the output projection's
    heads, the down projection's MLP axis), every device holds whole chunks, so the
    partial sums are the one-device ones and the fixed-order sum replaces the all-reduce
    of the plain product, whose order the mesh decides. On a mesh that splits the columns
    (the q/k/v and gate/up projections), each device's product is the one-device product
    of its own columns: with a contraction of at most MAX_CHUNK, XLA:CPU's own product
    gives a column the same bits whatever the number of columns."""
    if quantization.is_quantized(w):
        # A quantized weight (a Qwix QArray): Qwix's product, per row tile like a float
        # one; under the chunked contraction or the tile kernel, its dequantized value.
        if not _dequantizes(numerics):
            return quantization.product(rows, w)
        w = quantization.dequantize(w, rows)
    if numerics.tile_kernel is not None:
        return _kernel_product(rows, w, numerics, transposed=False, out_dtype=None)
    if not numerics.splits:
        return rows @ w
    partials = chunk_partials(rows, w, contraction_chunk(rows.shape[1], groups))
    return ordered_sum(partials, axis=0).astype(rows.dtype)


def _dequantizes(numerics: Numerics) -> bool:
    """Whether a quantized weight is dequantized before its product: under the chunked
    contraction of `deterministic="model-parallel"` and the tile kernel, whose fixed
    orders take float operands. Qwix's own product on a float activation dequantizes
    the same way (values times scales in the scales' dtype, then a float product), so
    the numbers are those of the float policy on the dequantized weight; the float
    weight is a temporary of the compiled step (whether XLA fuses it into the product is
    the backend's)."""
    return numerics.splits or numerics.tile_kernel is not None


def _kernel_product(rows, w, numerics: Numerics, *, transposed: bool, out_dtype) -> jax.Array:
    """A product through the policy's Pallas tile kernel (both operands in their promoted
    dtype, as `@` and `einsum` take them)."""
    # Imported here: Pallas takes a tenth of a second to import, and only this path needs it.
    from logitloop.ops.tile_matmul import tile_matmul

    dtype = jnp.result_type(rows, w)
    return tile_matmul(
        rows.astype(dtype),
        w.astype(dtype),
        w_transposed=transposed,
        out_dtype=out_dtype or dtype,
        interpret=numerics.tile_kernel == "interpret",
    )


def chunk_partials(rows: jax.Array, w: jax.Array, chunk: int) -> jax.Array:
    """`[M, K] x [K, N]` -> `[K / chunk, M, N]` float32: each `chunk` entries of the
    contraction's partial sum, as one batched product (what `product` adds in order; a
    device holding some of the chunks computes these for its own)."""
    m, k = rows.shape
    parts = k // chunk
    return jax.lax.dot_general(
        rows.reshape(m, parts, chunk).transpose(1, 0, 2),  # [C, M, chunk]
        w.reshape(parts, chunk, w.shape[-1]),
        (((2,), (1,)), ((0,), (0,))),
        preferred_element_type=jnp.float32,
    )


def head_product(rows: jax.Array, head: jax.Array, *, numerics: Numerics) -> jax.Array:
    """The LM head, `[M, E] x [V, E]^T -> [M, V]` float32; under a model-parallel policy
    (`numerics.splits`) over `gcd(V, MODEL_PARTS)` tiles of the vocabulary of one shape (a
    free view of the `[V, E]` weight), each `[V / tiles, E] x [E, M]` with the weight on
    the left (as the right operand, XLA:CPU's own product of llama-40m's `[32000, 512]`
    head at 8 rows took 14 ms a call against 4). One batched product, so a vocabulary
    split over a "model" axis of a size that divides the tile count gives every device
    whole tiles of the one-device shape."""
    if quantization.is_quantized(head):  # a quantized vocabulary table (Qwix's product)
        if not _dequantizes(numerics):
            return quantization.head_product(rows, head)
        head = quantization.dequantize(head, rows)
    if numerics.tile_kernel is not None:
        return _kernel_product(rows, head, numerics, transposed=True, out_dtype=jnp.float32)
    if not numerics.splits:
        return jnp.einsum("be,ve->bv", rows, head, preferred_element_type=jnp.float32)
    v, e = head.shape
    return tile_products(rows, head.reshape(math.gcd(v, MODEL_PARTS), -1, e))


def tile_products(rows: jax.Array, tiles: jax.Array) -> jax.Array:
    """`[M, E]` against vocabulary tiles `[T, V_t, E]` -> `[M, T * V_t]` float32, one
    batched product with the weight on the left (what `head_product` runs; a device
    holding some of the tiles computes these for its own)."""
    out = jax.lax.dot_general(
        tiles,
        jnp.broadcast_to(rows, (tiles.shape[0], *rows.shape)),
        (((2,), (2,)), ((0,), (0,))),
        preferred_element_type=jnp.float32,
    )  # [T, V_t, M]
    return out.transpose(2, 0, 1).reshape(rows.shape[0], -1)


def mean(x: jax.Array, *, numerics: Numerics, axis: int = -1) -> jax.Array:
    """`jnp.mean(x, axis, keepdims=True)`; under a fixed-order policy through `tree_sum`."""
    if not numerics.fixed:
        return jnp.mean(x, axis=axis, keepdims=True)
    return jnp.expand_dims(tree_sum(x, axis) / x.shape[axis], axis)
