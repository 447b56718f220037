"""Decode attention over a paged KV cache: a gather reference, a Pallas GPU kernel, a
shared-prefix (cascade) path, one dispatch.

The cache of one layer is a pool of pages shared by every row, and each row owns a list of
pages (after jax's `jax/experimental/pallas/ops/gpu/paged_attention.py`):

- `k_pages, v_pages: [Hkv, num_pages, page_size, D]`: heads first, as in the contiguous
  cache `[B, Hkv, S, D]` (`logitloop.models.layers`), so that one page of one head is one
  contiguous `[page_size, D]` tile the kernel loads whole, and a model-parallel mesh splits
  axis 0 as it splits the contiguous cache's heads.
- `block_tables: [B, pages_per_row] int32`: row b's token at position s lives in page
  `block_tables[b, s // page_size]`, slot `s % page_size`. Pages may sit anywhere in the
  pool, in any order, and two rows may name the same page (a shared prefix).
- `lengths: [B] int32`: row b holds tokens 0 .. lengths[b] - 1; its query is the token at
  position lengths[b] - 1, whose key and value are already written.

The query sees the keys `start <= s < length`: `start` is 0, or `length - window` with a
sliding `window` (the contiguous cache's rule `s <= q`, `s > q - window` at q = length - 1),
or given per row (`starts: [B] int32`, the first key a row's mask lets it see), whichever
is largest. Scores are `softcap * tanh(scale * q.k / softcap)` (no cap when `softcap` is
None) in float32. A row that sees no key (length 0) gets zeros. Table entries outside a
row's live pages (from the page of `start` to `cdiv(length, page_size)`) are never read
and may hold anything, -1 included: both paths replace them with page 0 (`live_tables`).

Example: page_size = 4, lengths = [6, 3], block_tables = [[7, 2, 0], [2, 5, 9]]: row 0's
tokens 0-3 are page 7, tokens 4-5 the first two slots of page 2; row 1's tokens 0-2 are
the first three slots of page 2 as well (a page shared with row 0 must then hold the same
keys for both: sharing is only safe for full pages, `logitloop.decoding.loop.pages`). Row 1's
entries 5 and 9 are past its live pages and are not read.

`paged_attention_reference` gathers every page of the table into a contiguous `[B, Hkv,
pages_per_row * page_size, D]` and runs one masked softmax (any platform); the XLA path
(`backend="xla"`) runs it over the shortest prefix of the tables that holds every row's
live pages, one of P/8, P/4, P/2 or P entries.
`paged_attention_pallas` runs a program per (row, KV head, split of the table) that walks
only the row's live pages, `pages_per_block` pages per step with an online softmax, all
the query heads of the KV head at once (grouped-query attention reads each page once); the
splits of a long row are combined afterwards (flash decoding). On a CPU it runs in
interpret mode; it lowers for CUDA from a CPU-only jaxlib through the Triton backend that
`logitloop.ops.sampling.pallas.COMPILER_PARAMS` chooses (tests/ops/test_paged_attention.py).
Triton loads only arrays whose sizes are powers of two, so the compiled kernel takes
power-of-two head dimensions (16 or more) and page sizes (`kernel_fits`); `backend="auto"`
runs the XLA path for other shapes.
`cascade_attention` (XLA, any platform; `paged_attention(..., prefix=SharedPrefix(...))`)
serves rows in groups whose tables start with the same pages (`generate`'s n samples of a
prompt): a group's shared pages are read once and attended by all its rows' queries in one
product, each row's own pages after them per row, and the two partial softmaxes are merged
by their log-sum-exp (`merge_partials`, which also combines the kernel's splits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl

from logitloop.ops.sampling.pallas import COMPILER_PARAMS

BACKENDS = ("auto", "xla", "pallas")
# Masked scores get this instead of -inf (a row that sees nothing must not become 0/0).
MASK_VALUE = float(np.finfo(np.float32).min)
# Triton's dot takes at least 16 in each dimension: the query heads of one KV head are
# padded up to a multiple of BLOCK_H, and a block of pages holds at least 16 keys.
BLOCK_H = 16
MIN_BLOCK_KEYS = 16
# The XLA path gathers only a prefix of the table (`_table_prefix`), one of these fractions
# of it, once the table has at least this many entries.
PREFIX_FRACTIONS = (8, 4, 2)
MIN_PREFIX_ENTRIES = 16


def first_keys(
    lengths: jax.Array,  # [B] int32
    window: int | None = None,
    starts: jax.Array | None = None,  # [B] int32
) -> jax.Array:
    """`[B]` int32: the first key each row sees, `max(starts, length - window, 0)` (the
    terms that are given)."""
    first = jnp.zeros_like(lengths) if starts is None else jnp.maximum(starts, 0)
    return first if window is None else jnp.maximum(first, lengths - window)


def live_page_range(
    starts: jax.Array,  # [...] int32: first visible key
    lengths: jax.Array,  # [...] int32
    page_size: int,
) -> tuple[jax.Array, jax.Array]:
    """`(first, end)`, each like `lengths`: the table entries a row reads, `first <= i <
    end`, from the page of its first visible key to `cdiv(length, page_size)`."""
    return starts // page_size, (lengths + page_size - 1) // page_size


def live_tables(
    block_tables: jax.Array,  # [B, P] int32
    starts: jax.Array,  # [B] int32
    lengths: jax.Array,  # [B] int32
    page_size: int,
) -> jax.Array:
    """`block_tables` with every entry outside a row's live pages replaced by page 0, so
    that a read of it stays inside the pool (the kernel's last block of pages may run past
    a row's end; the reference gathers every entry)."""
    first, end = live_page_range(starts, lengths, page_size)
    i = jnp.arange(block_tables.shape[1])[None, :]  # [1, P]
    return jnp.where((i >= first[:, None]) & (i < end[:, None]), block_tables, 0)


def _scores(raw: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    s = raw * scale
    return s if softcap is None else jnp.tanh(s / softcap) * softcap


def _check(q, k_pages, v_pages, block_tables, lengths, window, starts):
    """Shapes and dtypes, with the argument named (the values are traced: not checked)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [Hkv, num_pages, page_size, D], got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    b, h, d = q.shape
    hkv, _, _, dk = k_pages.shape
    if h % hkv:
        raise ValueError(f"q has {h} heads, not a multiple of the pages' {hkv} KV heads")
    if dk != d:
        raise ValueError(f"q's head dimension is {d} but the pages' is {dk}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"block_tables must be int32 [B={b}, pages_per_row], got {block_tables.dtype} "
            f"{block_tables.shape}"
        )
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [B={b}], got {lengths.dtype} {lengths.shape}")
    if starts is not None and (starts.shape != (b,) or starts.dtype != jnp.int32):
        raise ValueError(f"starts must be int32 [B={b}], got {starts.dtype} {starts.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window = {window} must be a positive number of keys, or None")


def gather_pages(
    pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    tables: jax.Array,  # [B, P] int32, every entry a page of the pool
) -> jax.Array:
    """`[B, Hkv, P * page_size, D]`: each row's pages laid end to end, the contiguous
    cache's layout (slot s holds the row's token at position s)."""
    hkv, _, page_size, d = pages.shape
    b, p = tables.shape
    return pages[:, tables].reshape(hkv, b, p * page_size, d).transpose(1, 0, 2, 3)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window"))
def paged_attention_reference(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    block_tables: jax.Array,  # [B, P] int32
    lengths: jax.Array,  # [B] int32
    starts: jax.Array | None = None,  # [B] int32
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """`[B, H, D]`: the module's attention, by gathering each row's pages into one
    contiguous `[B, Hkv, P * page_size, D]` and one masked softmax in float32."""
    _check(q, k_pages, v_pages, block_tables, lengths, window, starts)
    b, h, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    slots = block_tables.shape[1] * page_size
    starts = first_keys(lengths, window, starts)
    tables = live_tables(block_tables, starts, lengths, page_size)
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
    qg = q.reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    raw = jnp.einsum("bkgd,bksd->bkgs", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    s = jnp.arange(slots)[None, :]
    visible = (s >= starts[:, None]) & (s < lengths[:, None])  # [B, S]
    scores = jnp.where(visible[:, None, None, :], _scores(raw, scale, softcap), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v.astype(jnp.float32))
    out = jnp.where(visible.any(axis=1)[:, None, None, None], out, 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def _kernel(
    q_ref,  # [BLOCK_H, D]
    k_pages_ref,  # [num_pages, page_size, D]: one KV head's pool
    v_pages_ref,  # [num_pages, page_size, D]
    tables_ref,  # [pages_per_split] int32: this split's entries of the row's table
    bounds_ref,  # [2] int32: the row's first visible key and its length
    o_ref,  # [BLOCK_H, D] f32: unnormalised output of this split
    l_ref,  # [BLOCK_H] f32: softmax denominator of this split
    m_ref,  # [BLOCK_H] f32: running maximum of this split
    *,
    scale: float,
    softcap: float | None,
    pages_per_block: int,
):
    """One (row, KV head, split): an online softmax over the split's live pages, block of
    `pages_per_block` pages after block; blocks without a live page are not read."""
    split = pl.program_id(2)
    page_size, d = k_pages_ref.shape[1:]
    pages_per_split = tables_ref.shape[0]
    block_keys = pages_per_block * page_size
    start, length = bounds_ref[0], bounds_ref[1]
    first, end = live_page_range(start, length, page_size)
    split_start = split * pages_per_split  # the split's first table entry
    start_block = jnp.maximum(first - split_start, 0) // pages_per_block
    end_block = pl.cdiv(jnp.clip(end - split_start, 0, pages_per_split), pages_per_block)
    q = q_ref[...]

    def body(carry):
        i, o, denom, row_max = carry
        pages = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]  # [pages_per_block]
        k = k_pages_ref[pages].reshape(block_keys, d)
        v = v_pages_ref[pages].reshape(block_keys, d)
        raw = jax.lax.dot_general(
            q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [BLOCK_H, block_keys]
        slots = (split_start + i * pages_per_block) * page_size + jax.lax.iota(
            jnp.int32, block_keys
        )
        visible = ((slots >= start) & (slots < length))[None, :]  # [1, block_keys]
        s = jnp.where(visible, _scores(raw, scale, softcap), MASK_VALUE)
        m_next = jnp.maximum(row_max, s.max(axis=1))
        correction = jnp.exp(row_max - m_next)
        # Zeroed where masked: a block whose visible keys are few must not count the rest.
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [BLOCK_H, D]
        return i + 1, o * correction[:, None] + pv, denom * correction + p.sum(axis=1), m_next

    init = (
        start_block,
        jnp.zeros(o_ref.shape, jnp.float32),
        jnp.zeros(l_ref.shape, jnp.float32),
        jnp.full(m_ref.shape, MASK_VALUE, jnp.float32),
    )
    # A while loop, not `fori_loop` (the trip count is traced; see ops/sampling/pallas.py).
    _, o, denom, row_max = jax.lax.while_loop(lambda c: c[0] < end_block, body, init)
    o_ref[...] = o
    l_ref[...] = denom
    m_ref[...] = row_max


def _row(
    q,  # [Hkv, G', D], G' a multiple of BLOCK_H
    k_pages,  # [Hkv, num_pages, page_size, D]
    v_pages,  # [Hkv, num_pages, page_size, D]
    tables,  # [splits, pages_per_split]
    bounds,  # [2]: first visible key, length
    *,
    scale,
    softcap,
    pages_per_block,
    interpret,
):
    """One row's unnormalised per-split outputs `([splits, Hkv, G', D], l, m)`; batched by
    `jax.vmap`, which adds the row to the grid."""
    hkv, heads, d = q.shape
    _, num_pages, page_size, _ = k_pages.shape
    splits, pages_per_split = tables.shape
    pool_spec = pl.BlockSpec((None, num_pages, page_size, d), lambda h, j, s: (h, 0, 0, 0))
    kernel = functools.partial(
        _kernel, scale=scale, softcap=softcap, pages_per_block=pages_per_block
    )
    return pl.pallas_call(
        kernel,
        grid=(hkv, heads // BLOCK_H, splits),
        in_specs=[
            pl.BlockSpec((None, BLOCK_H, d), lambda h, j, s: (h, j, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, pages_per_split), lambda h, j, s: (s, 0)),
            pl.BlockSpec((2,), lambda h, j, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, BLOCK_H, d), lambda h, j, s: (s, h, j, 0)),
            pl.BlockSpec((None, None, BLOCK_H), lambda h, j, s: (s, h, j)),
            pl.BlockSpec((None, None, BLOCK_H), lambda h, j, s: (s, h, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, hkv, heads, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, hkv, heads), jnp.float32),
            jax.ShapeDtypeStruct((splits, hkv, heads), jnp.float32),
        ],
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
        name="paged_attention",
    )(q, k_pages, v_pages, tables, bounds)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "softcap", "window", "pages_per_block", "max_splits", "interpret"),
)
def paged_attention_pallas(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    block_tables: jax.Array,  # [B, P] int32
    lengths: jax.Array,  # [B] int32
    starts: jax.Array | None = None,  # [B] int32
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    pages_per_block: int = 8,
    max_splits: int = 16,
    interpret: bool = False,
) -> jax.Array:
    """`[B, H, D]`: the module's attention as the Pallas kernel (the reference's contract).

    `pages_per_block` pages are one step of a program (raised so a block holds at least
    16 keys, capped at the table); the table is cut into at most `max_splits` splits of
    whole blocks, run as separate programs and combined here.
    """
    _check(q, k_pages, v_pages, block_tables, lengths, window, starts)
    for name, value in (("pages_per_block", pages_per_block), ("max_splits", max_splits)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} = {value} must be a positive power of two")
    b, h, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    if not interpret and not kernel_fits(d, page_size):
        raise ValueError(
            f"the compiled kernel needs a power-of-two head dimension of at least 16 and a "
            f"power-of-two page_size, got {d} and {page_size} (backend='xla' takes any)"
        )
    num_entries = block_tables.shape[1]
    pages_per_block = min(pages_per_block, 1 << (num_entries - 1).bit_length())
    pages_per_block = max(pages_per_block, 1 << (-(-MIN_BLOCK_KEYS // page_size) - 1).bit_length())
    blocks = -(-num_entries // pages_per_block)
    splits = min(max_splits, blocks)
    pages_per_split = -(-blocks // splits) * pages_per_block
    starts = first_keys(lengths, window, starts)
    tables = live_tables(block_tables, starts, lengths, page_size)
    tables = jnp.pad(tables, ((0, 0), (0, splits * pages_per_split - num_entries)))
    tables = tables.reshape(b, splits, pages_per_split)

    group = h // hkv
    heads = -(-group // BLOCK_H) * BLOCK_H
    qg = q.reshape(b, hkv, group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, heads - group), (0, 0)))  # [B, Hkv, G', D]
    row = functools.partial(
        _row, scale=scale, softcap=softcap, pages_per_block=pages_per_block, interpret=interpret
    )
    o, denom, row_max = jax.vmap(row, in_axes=(0, None, None, 0, 0))(
        qg, k_pages, v_pages, tables, jnp.stack([starts, lengths], axis=1)
    )  # [B, splits, Hkv, G', D], [B, splits, Hkv, G'] twice
    out = merge_partials(o, denom, row_max, axis=1)  # [B, Hkv, G', D]
    return out[:, :, :group].reshape(b, h, d).astype(q.dtype)


def merge_partials(
    o: jax.Array,  # [..., K, ..., D] f32: unnormalised outputs of K parts of the keys
    denom: jax.Array,  # [..., K, ...] f32: each part's softmax denominator
    row_max: jax.Array,  # [..., K, ...] f32: each part's largest score (MASK_VALUE: none)
    axis: int,
) -> jax.Array:
    """The softmax over the union of K disjoint parts of the keys from each part's
    `(o, denom, row_max)`, exactly (each rescaled by `exp(row_max - max)`, the log-sum-exp
    merge); `axis` is the parts' axis, dropped. A query that sees no key in any part gets
    zeros."""
    top = row_max.max(axis=axis, keepdims=True)
    correction = jnp.exp(row_max - top)  # 0 for a part that read nothing
    o = (o * correction[..., None]).sum(axis=axis)
    denom = (denom * correction).sum(axis=axis)
    safe = jnp.where(denom > 0, denom, 1.0)[..., None]
    return jnp.where(denom[..., None] > 0, o / safe, 0.0)


def kernel_fits(head_dim: int, page_size: int) -> bool:
    """Can the compiled kernel take these shapes: Triton loads arrays whose sizes are
    powers of two, and its dot takes at least 16 in each dimension."""
    return head_dim >= 16 and not head_dim & (head_dim - 1) and not page_size & (page_size - 1)


def resolve_backend(
    backend: str, head_dim: int = 128, page_size: int = 16, sharded: bool = False
) -> str:
    """ "auto" -> "pallas" on a GPU when `kernel_fits` and the call is not `sharded`, else
    "xla"; other names are checked and returned. `sharded`: the arrays lie over a mesh,
    whose partitioner would run the kernel (a custom call) whole on every device, with its
    heads gathered; it partitions the XLA path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and not sharded and kernel_fits(head_dim, page_size) else "xla"
    return backend


def paged_attention(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    block_tables: jax.Array,  # [B, P] int32
    lengths: jax.Array,  # [B] int32
    starts: jax.Array | None = None,  # [B] int32
    *,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    prefix: SharedPrefix | None = None,
    backend: str = "auto",
    interpret: bool = False,
    sharded: bool = False,
) -> jax.Array:
    """Decode attention of one query per row over its pages (the module docstring), `[B, H,
    D]`. `scale` defaults to `D ** -0.5`. `backend="xla"` is the gather reference over the
    live prefix of the tables (any platform), `"pallas"` the kernel (`interpret=True` runs
    it on any platform, slowly), `"auto"` the kernel on a GPU and the XLA path elsewhere
    or when `sharded` (on a mesh: `resolve_backend`); chosen while tracing. With `prefix`
    (rows in groups that share their first pages), `"auto"` and `"xla"` run
    `cascade_attention` (XLA, any platform), which reads a group's shared pages once for
    all its rows; `"pallas"` runs the kernel, each row reading its own table whole."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k_pages, v_pages, block_tables, lengths, starts)
    kw = dict(scale=scale, softcap=softcap, window=window)
    chosen = resolve_backend(backend, q.shape[-1], k_pages.shape[2], sharded)
    if prefix is not None and backend != "pallas":
        return cascade_attention(*args, prefix=prefix, **kw)
    if chosen == "xla":
        return _table_prefix(*args, **kw)
    return paged_attention_pallas(*args, **kw, interpret=interpret)


def _table_prefix(q, k_pages, v_pages, block_tables, lengths, starts, **kw):
    """The reference over the shortest of P/8, P/4, P/2 or all P table entries that holds
    every row's live pages, picked at run time (tables of `MIN_PREFIX_ENTRIES` entries or
    more): the gather then reads what the rows hold, not what the table could hold. The
    entries left out are past every row's end, so only the order of float32 sums changes."""
    entries = block_tables.shape[1]
    if entries < MIN_PREFIX_ENTRIES:
        return paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, starts, **kw)
    extents = sorted({-(-entries // f) for f in PREFIX_FRACTIONS} | {entries})
    needed = jnp.max(live_page_range(lengths, lengths, k_pages.shape[2])[1])
    branch = jnp.sum(jnp.asarray(extents[:-1]) < needed)  # the shortest extent >= needed

    def prefix(e):
        return lambda t: paged_attention_reference(
            q, k_pages, v_pages, t[:, :e], lengths, starts, **kw
        )

    return jax.lax.switch(branch, [prefix(e) for e in extents], block_tables)


@struct.dataclass
class SharedPrefix:
    """Rows in groups of `n = B // U` consecutive rows (group u: rows `u * n .. u * n + n -
    1`, as `generate(..., n=n)` lays out a prompt's samples) whose tables start with their
    group's shared pages (`cascade_attention`).

    tables: Int[U, Ps] - group u's shared pages in token order; entries from
      `lengths[u] // page_size` on are not read.
    lengths: Int[U] - tokens the shared pages hold, a multiple of page_size (full pages).
    suffix_entries: int (static) - the most table entries a row holds after its group's
      shared pages (its own pages: a partial prompt page and the generated tokens').
    """

    tables: jax.Array
    lengths: jax.Array
    suffix_entries: int = struct.field(pytree_node=False)


def shared_entries(
    block_tables: jax.Array,  # [B, P] int32
    starts: jax.Array,  # [B] int32: first visible key (`first_keys`)
    prefix: SharedPrefix,
    page_size: int,
) -> jax.Array:
    """`[B]` int32: how many leading entries of each row's table are its group's shared
    pages: entries that name the group's page, or that lie wholly before the row's first
    visible key (never read unmasked: a sliding window may have released them). A row
    that no longer holds its group's pages (a finished row, a row given other pages)
    shares only as many as still match, so the cascade never reads a page the row does
    not hold."""
    groups, width = prefix.tables.shape
    n = block_tables.shape[0] // groups
    i = jnp.arange(width)[None, :]  # [1, Ps]
    count = jnp.repeat(prefix.lengths // page_size, n)[:, None]  # [B, 1]
    same = block_tables[:, :width] == jnp.repeat(prefix.tables, n, axis=0)
    ok = (i < count) & (same | (i < (starts // page_size)[:, None]))  # [B, Ps]
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)


def _check_prefix(prefix: SharedPrefix, rows: int, entries: int) -> None:
    groups, width = prefix.tables.shape if prefix.tables.ndim == 2 else (0, 0)
    if prefix.tables.ndim != 2 or prefix.tables.dtype != jnp.int32 or not groups:
        raise ValueError(f"prefix.tables must be int32 [U, Ps], got {prefix.tables.dtype} "
                         f"{prefix.tables.shape}")  # fmt: skip
    if rows % groups or width > entries:
        raise ValueError(
            f"prefix.tables has {groups} groups of {width} entries: the rows ({rows}) must be "
            f"a multiple of the groups and the entries at most block_tables' {entries}"
        )
    if prefix.lengths.shape != (groups,) or prefix.lengths.dtype != jnp.int32:
        raise ValueError(f"prefix.lengths must be int32 [U={groups}], got "
                         f"{prefix.lengths.dtype} {prefix.lengths.shape}")  # fmt: skip
    if prefix.suffix_entries < 1:
        raise ValueError(f"prefix.suffix_entries = {prefix.suffix_entries} must be at least 1")


def _partial_softmax(raw, visible, v, spec: str, scale: float, softcap: float | None):
    """`(o, denom, row_max)` of one part of the keys (`merge_partials`): `raw` scores
    `[..., S]`, `visible` broadcast to them, `spec` the einsum of probabilities and `v`."""
    s = jnp.where(visible, _scores(raw, scale, softcap), MASK_VALUE)
    row_max = s.max(axis=-1)
    p = jnp.where(visible, jnp.exp(s - row_max[..., None]), 0.0)
    return jnp.einsum(spec, p, v.astype(jnp.float32)), p.sum(axis=-1), row_max


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window"))
def cascade_attention(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, D]
    block_tables: jax.Array,  # [B, P] int32
    lengths: jax.Array,  # [B] int32
    starts: jax.Array | None = None,  # [B] int32
    *,
    prefix: SharedPrefix,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """`[B, H, D]`: the module's attention for rows in groups that share their first pages
    (shared-prefix or "cascade" attention, after FlashInfer and Hydragen), in two parts:

    1. the group's shared pages are gathered once per group, and the queries of its n rows
       times the G query heads of each KV head attend them in one product (`[n * G, Ps *
       page_size]` per group and KV head), each row masked to its own visible keys;
    2. each row attends its own `suffix_entries` table entries after its shared ones (its
       partial prompt page and its generated tokens), gathered per row;

    and the two partial softmaxes are merged exactly (`merge_partials`). The keys a row
    reads are those of the reference: a row shares only the entries of its table that are
    its group's pages (`shared_entries`). When some row holds more than `suffix_entries`
    entries past them (it shares fewer pages than its group, or the bound is too small),
    the whole batch runs the reference over the live prefix of the tables instead (one
    `lax.cond`), so the result never depends on the descriptor being right."""
    _check(q, k_pages, v_pages, block_tables, lengths, window, starts)
    _check_prefix(prefix, q.shape[0], block_tables.shape[1])
    page_size = k_pages.shape[2]
    starts = first_keys(lengths, window, starts)
    shared = shared_entries(block_tables, starts, prefix, page_size)
    suffix = min(prefix.suffix_entries, block_tables.shape[1])
    fits = jnp.all(live_page_range(starts, lengths, page_size)[1] <= shared + suffix)
    args = (q, k_pages, v_pages, block_tables, lengths, starts)
    kw = dict(scale=scale, softcap=softcap)
    return jax.lax.cond(
        fits,
        lambda: _cascade(*args, shared, prefix.tables, prefix.lengths, suffix, **kw),
        lambda: _table_prefix(*args, **kw),
    )


def _cascade(
    q,  # [B, H, D]
    k_pages,  # [Hkv, num_pages, page_size, D]
    v_pages,
    block_tables,  # [B, P]
    lengths,  # [B]
    starts,  # [B]: first visible key
    shared,  # [B]: shared entries (`shared_entries`)
    prefix_tables,  # [U, Ps]
    prefix_lengths,  # [U]
    suffix: int,
    *,
    scale,
    softcap,
):
    """`cascade_attention`'s two parts and their merge, every row within its bound."""
    b, h, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    groups, width = prefix_tables.shape
    n, g = b // groups, h // hkv
    entries = block_tables.shape[1]
    part = functools.partial(_partial_softmax, scale=scale, softcap=softcap)

    # 1. The shared pages, once per group: [U, Hkv, Ps * page_size, D].
    count = (prefix_lengths // page_size)[:, None]
    tables = jnp.where(jnp.arange(width)[None, :] < count, prefix_tables, 0)
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
    qg = q.reshape(groups, n, hkv, g, d)
    raw = jnp.einsum(
        "unkgd,uksd->ukngs", qg, k.astype(q.dtype), preferred_element_type=jnp.float32
    )  # [U, Hkv, n, G, Ps * page_size]: M = n * G queries per group and KV head
    s = jnp.arange(width * page_size)[None, :]
    end = jnp.minimum(shared * page_size, lengths)[:, None]  # [B, 1]
    visible = ((s >= starts[:, None]) & (s < end)).reshape(groups, 1, n, 1, -1)
    first = part(raw, visible, v, "ukngs,uksd->ukngd")
    # [U, Hkv, n, G, ...] -> [B, Hkv, G, ...]
    first = [jnp.moveaxis(x, 2, 1).reshape(b, hkv, g, *x.shape[4:]) for x in first]

    # 2. Each row's own entries after its shared ones: [B, Hkv, suffix * page_size, D].
    i = shared[:, None] + jnp.arange(suffix)[None, :]  # [B, suffix]
    live_from, live_end = live_page_range(starts, lengths, page_size)
    own = jnp.take_along_axis(block_tables, jnp.minimum(i, entries - 1), axis=1)
    tables = jnp.where((i >= live_from[:, None]) & (i < live_end[:, None]), own, 0)
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
    raw = jnp.einsum(
        "bkgd,bksd->bkgs", q.reshape(b, hkv, g, d), k.astype(q.dtype),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    s = shared[:, None] * page_size + jnp.arange(suffix * page_size)[None, :]  # [B, S']
    visible = ((s >= starts[:, None]) & (s < lengths[:, None]))[:, None, None, :]
    second = part(raw, visible, v, "bkgs,bksd->bkgd")

    out = merge_partials(*(jnp.stack(pair) for pair in zip(first, second, strict=True)), axis=0)
    return out.reshape(b, h, d).astype(q.dtype)
