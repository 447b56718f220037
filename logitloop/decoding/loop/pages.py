"""Page bookkeeping of a paged KV cache: which rows hold which pages of the pool.

The pool itself (per layer `k_pages, v_pages: [Hkv, num_pages, page_size, D]`,
`logitloop.ops.attention.paged`) is data; this module only decides which page a row's
token goes to. Every function is pure and jit-able over a `PageState` (after MaxText's
`page_manager.py`, allocation vectorised over the rows instead of a loop over them), so
the decode loop can allocate and free inside its compiled body with no host round trip.

- A row holds `pages_held(lengths) = cdiv(lengths, page_size)` pages: the first entries
  of its `tables` row. Its token at position s is in page `tables[b, s // page_size]`,
  slot `s % page_size`. Entries past the held pages are -1 (`NO_PAGE`): attention never
  reads them, and `layers.write_pages` drops a write that lands there.
- `ref_counts[p]` is the number of held table entries that name page p (0: free). Two
  rows name one page after `fork`, which shares only full pages: a row writes only at
  positions >= its length, which lie in its last, partial page or in pages not yet
  allocated, so a shared page is never written.
- `allocate` takes the lowest-numbered free pages, rows in row order; `free` returns a
  row's pages at once (a page shared with another row stays with it); `release_before`
  returns the pages a sliding window has left behind (their entries become -1: a row's
  held entries are then its first `pages_held` ones that are not -1).

- `shards` (static, 1 by default): the pool is `shards` pools of `N / shards` pages and the
  rows `shards` blocks of `B / shards`, contiguous both (a mesh's data shards): a row of
  block i takes pages of block i only (`allocate` runs per block), so its reads and writes
  stay on the device that holds its block of rows and pages (`logitloop.models.layers`).
  Page ids in `tables` stay global; the functions other than `allocate` need no change.

Example: page_size = 4, pages 0-5 free. `allocate(lengths=[6, 3])` gives row 0 pages
[0, 1] and row 1 page [2]. `fork(parents=[0, 0], children=[False, True])` frees row 1
(page 2 returns) and gives it row 0's one full page: tables [[0, 1], [0]], lengths [6, 4],
ref_counts [2, 1, 0, 0, 0, 0]. To continue row 1 as a copy of row 0, the caller grows it
with `allocate(lengths=[6, 6])` (it takes page 2 again) and copies slots 0-1 of page 1
into page 2 in every layer's pools (copy-on-write of the partial page); or it recomputes
those two tokens by a prefill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NO_PAGE = -1  # a table entry that names no page


@struct.dataclass
class PageState:
    """Who holds which page. Fields (B rows, P table entries per row, N pages):

    ref_counts: Int[N] - table entries naming each page; 0 for a free page.
    tables: Int[B, P] - row b's pages in token order; entries past its held pages -1.
    lengths: Int[B] - tokens each row holds (it holds cdiv(lengths, page_size) pages).
    page_size: int (static) - tokens per page.
    shards: int (static) - blocks of pages and of rows; block i's rows hold block i's pages.
    """

    ref_counts: jax.Array
    tables: jax.Array
    lengths: jax.Array
    page_size: int = struct.field(pytree_node=False)
    shards: int = struct.field(pytree_node=False, default=1)


def init_pages(
    num_pages: int, batch_size: int, pages_per_row: int, page_size: int, shards: int = 1
) -> PageState:
    """Every page free, every row empty. `page_size` must be a positive power of two;
    `shards` must divide `num_pages` and `batch_size`."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size = {page_size} must be a positive power of two")
    for name, value in (
        ("num_pages", num_pages),
        ("batch_size", batch_size),
        ("pages_per_row", pages_per_row),
    ):
        if value < 1:
            raise ValueError(f"{name} = {value} must be at least 1")
    for name, value in (("num_pages", num_pages), ("batch_size", batch_size)):
        if shards < 1 or value % shards:
            raise ValueError(f"{name} = {value} does not split into shards = {shards} blocks")
    return PageState(
        ref_counts=jnp.zeros(num_pages, jnp.int32),
        tables=jnp.full((batch_size, pages_per_row), NO_PAGE, jnp.int32),
        lengths=jnp.zeros(batch_size, jnp.int32),
        page_size=page_size,
        shards=shards,
    )


def pages_held(lengths: jax.Array, page_size: int) -> jax.Array:
    """Pages that `lengths` tokens fill: `cdiv(lengths, page_size)`."""
    return (lengths + page_size - 1) // page_size


def _held_entries(state: PageState) -> jax.Array:
    """`[B, P]` bool: the table entries a row holds (its first `pages_held` entries, less
    those `release_before` emptied)."""
    held = pages_held(state.lengths, state.page_size)
    return (jnp.arange(state.tables.shape[1])[None, :] < held[:, None]) & (state.tables >= 0)


def free_pages(state: PageState) -> jax.Array:
    """`[]` int32: pages no row holds (inside a program, or on a host copy of `state`:
    NumPy in, NumPy out, no eager program)."""
    return (state.ref_counts == 0).sum(dtype=jnp.int32)


def free_by_shard(state: PageState) -> jax.Array:
    """`[shards]` int32: pages no row holds in each block of the pool (a host copy of
    `state` gives NumPy, as `free_pages`)."""
    return (state.ref_counts == 0).reshape(state.shards, -1).sum(axis=1, dtype=jnp.int32)


def _allocate_by_shard(
    state: PageState, lengths: jax.Array, order: jax.Array | None
) -> tuple[PageState, jax.Array]:
    """`allocate` in each block of rows from its block of pages (`PageState.shards`)."""
    d = state.shards
    (b, p), n = state.tables.shape, state.ref_counts.shape[0]
    base = (jnp.arange(d, dtype=jnp.int32) * (n // d))[:, None, None]  # [d, 1, 1]
    tables = state.tables.reshape(d, b // d, p)
    blocks = PageState(
        state.ref_counts.reshape(d, n // d),
        jnp.where(tables >= 0, tables - base, NO_PAGE),  # ids within the block
        state.lengths.reshape(d, b // d),
        state.page_size,
    )
    if order is None:
        order = jnp.arange(b)
    rank = jnp.argsort(order).reshape(d, b // d)  # each row's place in the serving order
    served, granted = jax.vmap(allocate)(
        blocks, lengths.reshape(d, b // d), jnp.argsort(rank, axis=1)
    )
    tables = jnp.where(served.tables >= 0, served.tables + base, NO_PAGE).reshape(b, p)
    return (
        state.replace(
            ref_counts=served.ref_counts.reshape(n),
            tables=tables,
            lengths=served.lengths.reshape(b),
        ),
        granted.reshape(b),
    )


def _add_refs(ref_counts: jax.Array, pages: jax.Array, where: jax.Array, delta: int) -> jax.Array:
    """`ref_counts` plus `delta` once per entry of `pages` where `where` (duplicates add)."""
    n = ref_counts.shape[0]
    return ref_counts.at[jnp.where(where, pages, n)].add(delta, mode="drop")


def allocate(
    state: PageState, lengths: jax.Array, order: jax.Array | None = None
) -> tuple[PageState, jax.Array]:
    """Grow rows to hold `lengths` ([B] int32) tokens; returns the state and `granted` [B].

    A row whose `lengths` entry is at most its current length keeps its pages and is
    granted. A row that would need more than its P table entries is refused. The others
    take the lowest-numbered free pages, served in `order` ([B] int32, a permutation of
    the rows, e.g. by arrival; default row order), until the first that does not fit: it,
    and every row served after it that needs a page, is refused (a refused row is
    unchanged), so the rows served last are the ones refused. With `shards` > 1 each
    block of rows is served so from its own block of pages.
    """
    if state.shards > 1:
        return _allocate_by_shard(state, lengths, order)
    if order is not None:
        back = jnp.argsort(order)
        served, granted = allocate(
            state.replace(tables=state.tables[order], lengths=state.lengths[order]),
            lengths[order],
        )
        rows = served.replace(tables=served.tables[back], lengths=served.lengths[back])
        return rows, granted[back]
    num_pages = state.ref_counts.shape[0]
    entries = state.tables.shape[1]
    lengths = jnp.maximum(lengths.astype(jnp.int32), state.lengths)
    held = pages_held(state.lengths, state.page_size)  # [B]
    want = pages_held(lengths, state.page_size)  # [B]
    fits_table = want <= entries
    need = jnp.where(fits_table, want - held, 0)
    end = jnp.cumsum(need)  # [B]: free-list entries taken by rows up to b
    granted = fits_table & ((need == 0) | (end <= free_pages(state)))
    # Granted rows that need pages form a prefix of the rows that need pages, so `end -
    # need` is where each one's pages start in the free list.
    free_list = jnp.nonzero(state.ref_counts == 0, size=num_pages, fill_value=num_pages)[0]
    i = jnp.arange(entries)[None, :]  # [1, P]
    new = granted[:, None] & (i >= held[:, None]) & (i < want[:, None])  # [B, P]
    source = jnp.clip((end - need)[:, None] + i - held[:, None], 0, num_pages - 1)
    tables = jnp.where(new, free_list[source], state.tables)
    return (
        state.replace(
            ref_counts=_add_refs(state.ref_counts, tables, new, 1),
            tables=tables,
            lengths=jnp.where(granted, lengths, state.lengths),
        ),
        granted,
    )


def free(state: PageState, rows: jax.Array) -> PageState:
    """Release every page of the rows where `rows` ([B] bool) is True and empty them; a
    page no other row holds is free at once."""
    held = _held_entries(state) & rows[:, None]
    return state.replace(
        ref_counts=_add_refs(state.ref_counts, state.tables, held, -1),
        tables=jnp.where(rows[:, None], NO_PAGE, state.tables),
        lengths=jnp.where(rows, 0, state.lengths),
    )


def share(state: PageState, rows: jax.Array, prefix: jax.Array, count: jax.Array) -> PageState:
    """Each row b with `rows[b]` ([B] bool) drops its own pages and holds the first
    `count[b]` ([B] int32) pages of `prefix[b]` ([B, P] int32: full pages another row or a
    prefix cache holds, which it only reads): it then holds `page_size * count[b]` tokens,
    and each shared page one more reference."""
    ps = state.page_size
    freed = free(state, rows)
    shared = (
        rows[:, None]
        & (jnp.arange(state.tables.shape[1])[None, :] < count[:, None])
        & (prefix >= 0)  # an entry a sliding window released (`release_before`) stays empty
    )
    return freed.replace(
        ref_counts=_add_refs(freed.ref_counts, prefix, shared, 1),
        tables=jnp.where(shared, prefix, freed.tables),
        lengths=jnp.where(rows, count * ps, freed.lengths),
    )


def fork(state: PageState, parents: jax.Array, children: jax.Array) -> PageState:
    """Each row b with `children[b]` drops its own pages and shares the full pages of row
    `parents[b]` ([B] int32), as the parents were before the call: it then holds
    `page_size * (lengths[parent] // page_size)` tokens. The parent's partial last page is
    not shared; copying it (or recomputing its tokens) is the caller's job (module
    docstring)."""
    full = state.lengths[parents] // state.page_size
    return share(state, children, state.tables[parents], full)


def release_before(state: PageState, starts: jax.Array) -> PageState:
    """Return each row's pages that lie wholly before position `starts` ([B] int32; 0 keeps
    every page): a sliding window that shows a row's queries only positions >= `starts`
    from now on never reads them again. Their entries become -1; the row's length, and so
    the place of its later pages, does not change."""
    ps = state.page_size
    before = jnp.arange(state.tables.shape[1])[None, :] < (starts // ps)[:, None]
    gone = _held_entries(state) & before
    return state.replace(
        ref_counts=_add_refs(state.ref_counts, state.tables, gone, -1),
        tables=jnp.where(gone, NO_PAGE, state.tables),
    )


def retain(state: PageState, pages: jax.Array, delta: int) -> PageState:
    """`ref_counts` plus `delta` (1 or -1) once for each entry of `pages` ([K] int32, -1
    entries skipped): a holder that is not a row (a prefix cache) takes or drops pages."""
    return state.replace(ref_counts=_add_refs(state.ref_counts, pages, pages >= 0, delta))
