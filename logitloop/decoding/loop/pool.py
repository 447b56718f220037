"""A paged KV cache in the decode loop: one pool of pages shared by every row
(`generate_many(..., kv_cache_tokens=N)`), and the hooks the loop calls with it.

With a pool, `DecodeState.cache` holds per layer `dict(k_pages, v_pages)` of
`[Hkv, num_pages, page_size, D]` (`ModelRunner.init_pool`) and `DecodeState.pages` a
`Pool`: which row holds which pages (`pages.PageState`, the one copy of the page tables,
`attach`ed to the layers for each forward pass), each row's arrival number, and the rows
parked (preempted) or stalled (refused a page). Without a pool both hooks are skipped and
the loop runs as it always did. On a mesh the pool is one pool per data shard
(`PoolShape.shards`): a row takes pages of its own shard only (`pages.PageState.shards`).

- Each decode step first grows every running row to the tokens the step writes
  (`grow`: `pages.allocate` in arrival order, so the newest rows are the ones refused);
  a refused row feeds nothing and draws nothing this step (`stalled`), and the loop's chunk
  ends (`runnable`, `any_stalled`) so the host can preempt.
- After the step, the rows that just finished return their pages (`release`), on device.
- Admission (`admit`, `admitted`): the new rows' pages are allocated for their prompts and
  the prefill writes into the shared pool through the new rows' tables.
- Preemption (`park`): the host frees a row's pages and parks it in its slot; its sampling
  state (tokens, history, stop windows, processor states, automaton state) stays as it is.
  `resume` gives it pages again (sharing the prompt's pages a prefix cache holds) and
  recomputes the keys and values of the rest of its prompt and the tokens it generated,
  so it continues exactly where it stopped: its noise is keyed by (seed, position), which
  have not changed.
- Layer groups (`shape_for`): a model whose layers' windows differ has one page table and
  one pool of pages per window (`Pool.groups`); every hook above acts in each group, and a
  row is granted a page only where every group grants it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.loop import pages as paging
from logitloop.decoding.loop.pages import PageState
from logitloop.decoding.loop.runner import runner_jit


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """The static shape of a pool: `num_pages` pages of `page_size` tokens, `entries`
    table entries per row (enough for the job's longest row); `window`: the sliding window
    of the layers the main page table serves (None: global layers, or none of them has one);
    `shards`: the pool split into this many pools, one per data shard of a mesh
    (`PageState.shards`; every group's pool is split so).

    Layer groups (`layer_groups`): a model whose layers' windows differ (Gemma 2 and 3
    alternate local and global layers) gets one page table and one pool of pages per
    window. `groups` holds `(window, num_pages)` of each group after the main one, and
    `layer_groups[i]` the group of layer i (0: the main table; () when one table serves
    every layer). Each step returns the pages behind each group's window in that group
    only, so a local layer's pages go back while the global layers keep theirs."""

    num_pages: int
    page_size: int
    entries: int
    window: int | None = None
    groups: tuple[tuple[int, int], ...] = ()
    layer_groups: tuple[int, ...] = ()
    shards: int = 1

    def layer_pages(self) -> int | tuple[int, ...]:
        """Pages of each layer's pool (`ModelRunner.init_pool`): `num_pages`, or one count
        per layer, its group's."""
        if not self.layer_groups:
            return self.num_pages
        counts = (self.num_pages, *(n for _, n in self.groups))
        return tuple(counts[g] for g in self.layer_groups)


def shape_for(windows: Any, num_pages: int, page_size: int, entries: int, rows: int) -> PoolShape:
    """The pool of `num_pages` pages for a model with these per-layer windows (None:
    global) and at most `rows` rows at once. One group per distinct window: the main one
    (`num_pages` pages) serves the global layers, or, when every layer has a window, the
    longest; each other group (a shorter window) gets the pages its rows hold at most once
    their windows have left the rest, `rows * (cdiv(window, page_size) + 1)`, plus one
    row's `entries` (a prompt, or a resumed row's history, is written whole before the next
    step releases what lies behind the window), and never more than `num_pages`."""
    windows = tuple(windows)
    # None first, then the longest window: the main group is the one that reaches furthest.
    distinct = sorted(set(windows), key=lambda w: (w is not None, -(w or 0)))
    main = distinct[0] if distinct else None
    if len(distinct) < 2:
        return PoolShape(num_pages, page_size, entries, main)
    groups = tuple(
        (w, min(num_pages, rows * (-(-w // page_size) + 1) + entries)) for w in distinct[1:]
    )
    layer_groups = tuple(distinct.index(w) for w in windows)
    return PoolShape(num_pages, page_size, entries, main, groups, layer_groups)


@struct.dataclass
class Pool:
    """The page bookkeeping the loop carries (B rows).

    pages: who holds which page (`PageState`, the page tables' one copy) in the main group;
    arrival: [B] i32, order of admission (larger = newer); parked: [B] bool, preempted and
    holding no pages until `resume`; stalled: [B] bool, refused a page at the last step;
    groups: the `PageState` of each further layer group (`PoolShape.groups`; () without).
    Every group holds the same rows with the same lengths: a row needs pages in each.
    """

    pages: PageState
    arrival: jax.Array
    parked: jax.Array
    stalled: jax.Array
    groups: tuple[PageState, ...] = ()

    def states(self) -> tuple[PageState, ...]:
        """Every group's `PageState`, the main one first."""
        return (self.pages, *self.groups)

    def with_states(self, states: Any) -> Pool:
        """This pool with every group's `PageState` replaced (as `states` orders them)."""
        states = tuple(states)
        return self.replace(pages=states[0], groups=states[1:])


def init(runner: Any, weights: Any, shape: PoolShape, batch: int) -> tuple[Any, Pool]:
    """An empty pool: the layers' pages (zeros) and every row holding none."""
    cache = runner.init_pool(weights, shape.layer_pages(), shape.page_size)
    counts = (shape.num_pages, *(n for _, n in shape.groups))
    states = [
        paging.init_pages(n, batch, shape.entries, shape.page_size, shape.shards) for n in counts
    ]
    no = jnp.zeros((batch,), bool)
    return cache, Pool(states[0], jnp.zeros((batch,), jnp.int32), no, no, tuple(states[1:]))


def free_counts(states: tuple[PageState, ...]) -> list:
    """Free pages in each group of `pool.states()` (the main one first): on a host copy,
    NumPy counts (`paging.free_pages`)."""
    return [paging.free_pages(state) for state in states]


def layer_tables(pool: Pool, shape: PoolShape) -> Any:
    """What `attach` takes for the pool's rows: the one page table [B, P], or with layer
    groups a list of one [B, P] per layer, its group's."""
    if not shape.layer_groups:
        return pool.pages.tables
    states = pool.states()
    return [states[g].tables for g in shape.layer_groups]


def attach(cache: Any, tables: Any) -> Any:
    """The pool's layers with page tables, as the model reads them: `tables` [B, P] for
    every layer, or a list of one per layer (`layer_tables`)."""
    if not isinstance(tables, list):
        tables = [tables] * len(cache)
    return [dict(layer, tables=t) for layer, t in zip(cache, tables, strict=True)]


def _allocate(
    states: tuple[PageState, ...], lengths: jax.Array, order: jax.Array | None = None
) -> tuple[tuple[PageState, ...], jax.Array]:
    """`pages.allocate` in every group; a row is granted only where every group grants it
    (else it is unchanged in all). The rows each group grants are a prefix of its needy
    rows in `order`, so the rows every group grants fit again in each."""
    grown = [paging.allocate(state, lengths, order) for state in states]
    granted = functools.reduce(jnp.logical_and, [g for _, g in grown])
    if len(states) == 1:
        return (grown[0][0],), granted
    lengths = jnp.where(granted, lengths, states[0].lengths)
    return tuple(paging.allocate(state, lengths, order)[0] for state in states), granted


def _free(pool: Pool, rows: jax.Array) -> Pool:
    """`pool` with the rows where `rows` ([B] bool) holding no page in any group."""
    return pool.with_states(paging.free(state, rows) for state in pool.states())


def detach(cache: Any) -> Any:
    """The pool's layers without tables (they live in `Pool.pages` only)."""
    return [{k: v for k, v in layer.items() if k != "tables"} for layer in cache]


def runnable(state: Any) -> jax.Array:
    """[B] bool: rows the loop runs (not finished; with a pool, not parked)."""
    if state.pages is None:
        return ~state.done
    return ~state.done & ~state.pages.parked


def any_stalled(state: Any) -> jax.Array:
    """[] bool: a row was refused a page (always False without a pool)."""
    if state.pages is None:
        return jnp.zeros((), bool)
    return jnp.any(state.pages.stalled)


def grow(state: Any, shape: PoolShape) -> tuple[Any, jax.Array]:
    """Give each running row the pages for the token it feeds at position `prompt_len +
    num_tokens - 1`, in every layer group; returns the state and [B] bool, the rows that
    feed one this step (those every group granted).

    A group with a window (`shape.window`, `shape.groups`) first returns its pages wholly
    before the first position a query at that position (or later) sees there,
    `position - window + 1`."""
    pool = state.pages
    run = runnable(state)
    windows = (shape.window, *(w for w, _ in shape.groups))
    states = []
    for pages, window in zip(pool.states(), windows, strict=True):
        if window is not None:
            first = jnp.maximum(state.prompt_len + state.num_tokens - window, 0)
            pages = paging.release_before(pages, jnp.where(run, first, 0))
        states.append(pages)
    want = jnp.where(run, state.prompt_len + state.num_tokens, pool.pages.lengths)
    states, granted = _allocate(tuple(states), want, order=jnp.argsort(pool.arrival))
    live = run & granted
    return state.replace(pages=pool.with_states(states).replace(stalled=run & ~granted)), live


def grow_drafts(state: Any, live: jax.Array, num: jax.Array) -> tuple[Any, jax.Array]:
    """Give each `live` row ([B] bool, granted its last token's page by `grow`) the pages
    for its `num` ([B] i32) drafts, which a speculative verification writes at the
    positions after that token; returns the state and `num`, 0 for the rows refused (they
    verify no draft, and take a plain step's one token)."""
    pool = state.pages
    propose = live & (num > 0)
    want = jnp.where(propose, state.prompt_len + state.num_tokens + num, pool.pages.lengths)
    states, granted = _allocate(pool.states(), want, order=jnp.argsort(pool.arrival))
    return state.replace(pages=pool.with_states(states)), jnp.where(propose & granted, num, 0)


def release(before: Any, after: Any) -> Any:
    """`after` with the pages of the rows that finished since `before` returned."""
    return after.replace(pages=_free(after.pages, after.done & ~before.done))


def admit(
    state: Any, slot: jax.Array, lengths: jax.Array, prefix: Any = None, *, shape: PoolShape
) -> tuple[Any, Any]:
    """Pages for G new rows' prompts (`slot` [G], S = a dummy row; `lengths` [G]) in every
    layer group (`shape`, the `PoolShape`; the host admits rows only where each group has
    room); returns the state and the pool attached to the new rows' tables (what their
    prefill writes). `prefix`: `(pages [G, P], count [G])`, full pages of cached prompt
    prefixes each row shares (`pages.share`) before it takes new pages for the rest of its
    prompt (one page table only: rows of a pool with layer groups own their pages)."""
    pool = state.pages
    batch = pool.arrival.shape[0]
    rows = jnp.zeros((batch,), bool).at[slot].set(True, mode="drop")
    if prefix is None:
        pool = _free(pool, rows)
    else:
        if pool.groups:
            raise ValueError("pages shared between rows need one page table for every layer")
        shared = jnp.full(pool.pages.tables.shape, paging.NO_PAGE, jnp.int32)
        count = jnp.zeros((batch,), jnp.int32).at[slot].set(prefix[1], mode="drop")
        shared = shared.at[slot].set(prefix[0], mode="drop")
        pool = pool.replace(pages=paging.share(pool.pages, rows, shared, count))
    lengths = pool.pages.lengths.at[slot].set(lengths, mode="drop")
    states, _ = _allocate(pool.states(), lengths)
    pool = pool.with_states(states)
    arrival = jnp.max(pool.arrival) + 1 + jnp.arange(slot.shape[0], dtype=jnp.int32)
    tables = jax.tree.map(
        lambda t: jnp.take(t, slot, axis=0, mode="fill", fill_value=paging.NO_PAGE),
        layer_tables(pool, shape),
    )
    pool = pool.replace(
        arrival=pool.arrival.at[slot].set(arrival, mode="drop"),
        parked=pool.parked & ~rows,
        stalled=pool.stalled & ~rows,
    )
    return state.replace(pages=pool), attach(state.cache, tables)


def admitted(state: Any, fresh: Any, put: Any) -> Any:
    """`state` with the prefilled rows `fresh` put into their slots by `put(big, small)`:
    every per-row field, the pool the prefill wrote, and the pages of every finished row
    (one whose first token ended it) returned."""
    rows = jax.tree.map(put, state.replace(cache=None, pages=None), fresh.replace(cache=None))
    return rows.replace(cache=detach(fresh.cache), pages=_free(state.pages, rows.done))


@functools.partial(jax.jit, donate_argnames=("state",))
def park(state: Any, slot: jax.Array) -> Any:
    """Preempt the row in `slot` ([] i32): its pages return to the pool and it waits."""
    pool = state.pages
    rows = jnp.arange(pool.arrival.shape[0]) == slot
    pool = _free(pool, rows)
    return state.replace(
        pages=pool.replace(parked=pool.parked | rows, stalled=jnp.zeros_like(pool.stalled))
    )


@functools.partial(runner_jit, static_argnames=("program", "width"), donate_argnames=("state",))
def resume(
    program: Any,
    weights: Any,
    state: Any,
    slot: jax.Array,
    shared: jax.Array,
    per_row: Any = None,
    *,
    width: int,
) -> Any:
    """Give the parked row in `slot` ([] i32) pages again and recompute the keys and values
    of its prompt and generated tokens but the last (which the next step feeds): its prompt
    in a prompt pass, its generated tokens in one decode-kind pass over the buffer's columns
    (as a speculative verification is), so a deterministic runner computes every position
    with the products and sums it had the first time and the row's keys and values come
    back bit for bit.

    `shared` ([P] i32, -1 past them): full pages of the row's prompt that a prefix cache
    holds; the row reads them (`pages.share`) and its prompt pass computes only the
    `width` (static, at least the rest of the prompt) columns from the first position after
    them, as an admission's prefill after cached pages does. `per_row`: the slots' per-row
    state (`ll.Rows` [B]: their LoRA adapters, steering vectors), or None; the row
    recomputes under its own. It captures nothing (`Rows.capture`): the states the row's
    passes captured the first time stay in `DecodeState.capture`."""
    pool = state.pages
    batch = pool.arrival.shape[0]
    rows = jnp.arange(batch) == slot
    prompt_len = state.prompt_len[slot]
    length = prompt_len + state.num_tokens[slot] - 1
    count = jnp.sum(shared >= 0, dtype=jnp.int32)
    tables = jnp.broadcast_to(shared, pool.pages.tables.shape)
    pool = pool.replace(pages=paging.share(pool.pages, rows, tables, jnp.where(rows, count, 0)))
    states, _ = _allocate(pool.states(), jnp.where(rows, length, pool.pages.lengths))
    pool = pool.with_states(states)
    # On a mesh the passes take one row per data shard, the slot's and a row that writes
    # nothing in each other shard, so each device reads and writes its own pages only.
    per = batch // program.layout.row_multiple
    take = slot % per + per * jnp.arange(program.layout.row_multiple)  # [d]
    real = (take == slot)[:, None]
    tables = jax.tree.map(
        lambda t: jnp.where(real, t[take], paging.NO_PAGE), layer_tables(pool, program.pool)
    )
    cache = attach(state.cache, tables)
    if per_row is not None:  # the passes' rows: the slot's adapter (the base for the
        per_row = per_row.take(take)  # others) and vectors (the others feed no position)
        per_row = per_row.replace(capture=())  # its captured states are kept (above)
        if per_row.adapter is not None:
            per_row = per_row.replace(adapter=jnp.where(take == slot, per_row.adapter, -1))
    history = state.history.tokens[take]  # [d, P + N]
    buffer = state.tokens.shape[1]  # N: the generated tokens' buffer
    start = count * program.pool.page_size  # the prompt's first position not in a shared page
    begin = jnp.minimum(start, history.shape[1] - width)
    cols = begin + jnp.arange(width)[None]
    mesh = program.layout.row_mesh
    _, cache = program.runner.forward(
        weights,
        jnp.maximum(jax.lax.dynamic_slice_in_dim(history, begin, width, axis=1), 0),
        jnp.where(real & (cols >= start) & (cols < prompt_len), cols, -1),
        cache,
        prompt=True,
        mesh=mesh,
        rows=per_row,
    )
    cols = prompt_len + jnp.arange(buffer)[None]
    _, cache = program.runner.forward(
        weights,
        jnp.maximum(jax.lax.dynamic_slice_in_dim(history, prompt_len, buffer, axis=1), 0),
        jnp.where(real & (cols < length), cols, -1),
        cache,
        mesh=mesh,
        rows=per_row,
    )
    return state.replace(cache=detach(cache), pages=pool.replace(parked=pool.parked & ~rows))
