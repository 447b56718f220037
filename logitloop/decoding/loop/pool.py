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
  `resume` gives it pages again and recomputes the keys and values of its prompt and the
  tokens it generated in one prompt pass, so it continues exactly where it stopped: its
  noise is keyed by (seed, position), which have not changed.
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
    table entries per row (enough for the job's longest row); `window`: the longest
    sliding window of a model whose every layer has one (`window_of`), or None; `shards`:
    the pool split into this many pools, one per data shard of a mesh (`PageState.shards`).
    """

    num_pages: int
    page_size: int
    entries: int
    window: int | None = None
    shards: int = 1


def window_of(windows: Any) -> int | None:
    """The pool's `window` for a model with these per-layer windows (None: global): the
    longest, when every layer has one; else None. One page table serves every layer, so a
    page may go only once every layer's window has left it: with a global layer (Gemma 2
    and 3 alternate local and global layers) a row keeps all its pages."""
    windows = tuple(windows)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


@struct.dataclass
class Pool:
    """The page bookkeeping the loop carries (B rows).

    pages: who holds which page (`PageState`, the page tables' one copy);
    arrival: [B] i32, order of admission (larger = newer); parked: [B] bool, preempted and
    holding no pages until `resume`; stalled: [B] bool, refused a page at the last step.
    """

    pages: PageState
    arrival: jax.Array
    parked: jax.Array
    stalled: jax.Array


def init(runner: Any, weights: Any, shape: PoolShape, batch: int) -> tuple[Any, Pool]:
    """An empty pool: the layers' pages (zeros) and every row holding none."""
    cache = runner.init_pool(weights, shape.num_pages, shape.page_size)
    state = paging.init_pages(shape.num_pages, batch, shape.entries, shape.page_size, shape.shards)
    no = jnp.zeros((batch,), bool)
    return cache, Pool(state, jnp.zeros((batch,), jnp.int32), no, no)


def attach(cache: Any, tables: jax.Array) -> Any:
    """The pool's layers with the page tables `tables` [B, P], as the model reads them."""
    return [dict(layer, tables=tables) for layer in cache]


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


def grow(state: Any, window: int | None = None) -> tuple[Any, jax.Array]:
    """Give each running row the pages for the token it feeds at position `prompt_len +
    num_tokens - 1`; returns the state and [B] bool, the rows that feed one this step.

    `window` (`PoolShape.window`): first return the pages wholly before the first position
    a query at that position (or later) sees, `position - window + 1`."""
    pool = state.pages
    run = runnable(state)
    pages = pool.pages
    if window is not None:
        first = jnp.maximum(state.prompt_len + state.num_tokens - window, 0)
        pages = paging.release_before(pages, jnp.where(run, first, 0))
    want = jnp.where(run, state.prompt_len + state.num_tokens, pages.lengths)
    pages, granted = paging.allocate(pages, want, order=jnp.argsort(pool.arrival))
    live = run & granted
    return state.replace(pages=pool.replace(pages=pages, stalled=run & ~granted)), live


def grow_drafts(state: Any, live: jax.Array, num: jax.Array) -> tuple[Any, jax.Array]:
    """Give each `live` row ([B] bool, granted its last token's page by `grow`) the pages
    for its `num` ([B] i32) drafts, which a speculative verification writes at the
    positions after that token; returns the state and `num`, 0 for the rows refused (they
    verify no draft, and take a plain step's one token)."""
    pool = state.pages
    propose = live & (num > 0)
    want = jnp.where(propose, state.prompt_len + state.num_tokens + num, pool.pages.lengths)
    pages, granted = paging.allocate(pool.pages, want, order=jnp.argsort(pool.arrival))
    return state.replace(pages=pool.replace(pages=pages)), jnp.where(propose & granted, num, 0)


def release(before: Any, after: Any) -> Any:
    """`after` with the pages of the rows that finished since `before` returned."""
    newly = after.done & ~before.done
    pool = after.pages
    return after.replace(pages=pool.replace(pages=paging.free(pool.pages, newly)))


def admit(state: Any, slot: jax.Array, lengths: jax.Array, prefix: Any = None) -> tuple[Any, Any]:
    """Pages for G new rows' prompts (`slot` [G], S = a dummy row; `lengths` [G]); returns
    the state and the pool attached to the new rows' tables (what their prefill writes).
    `prefix`: `(pages [G, P], count [G])`, full pages of cached prompt prefixes each row
    shares (`pages.share`) before it takes new pages for the rest of its prompt."""
    pool = state.pages
    batch = pool.arrival.shape[0]
    rows = jnp.zeros((batch,), bool).at[slot].set(True, mode="drop")
    if prefix is None:
        pages = paging.free(pool.pages, rows)
    else:
        shared = jnp.full(pool.pages.tables.shape, paging.NO_PAGE, jnp.int32)
        count = jnp.zeros((batch,), jnp.int32).at[slot].set(prefix[1], mode="drop")
        shared = shared.at[slot].set(prefix[0], mode="drop")
        pages = paging.share(pool.pages, rows, shared, count)
    pages, _ = paging.allocate(pages, pages.lengths.at[slot].set(lengths, mode="drop"))
    arrival = jnp.max(pool.arrival) + 1 + jnp.arange(slot.shape[0], dtype=jnp.int32)
    tables = jnp.take(pages.tables, slot, axis=0, mode="fill", fill_value=paging.NO_PAGE)
    pool = pool.replace(
        pages=pages,
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
    pool = state.pages
    return rows.replace(
        cache=detach(fresh.cache), pages=pool.replace(pages=paging.free(pool.pages, rows.done))
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def park(state: Any, slot: jax.Array) -> Any:
    """Preempt the row in `slot` ([] i32): its pages return to the pool and it waits."""
    pool = state.pages
    rows = jnp.arange(pool.arrival.shape[0]) == slot
    return state.replace(
        pages=pool.replace(
            pages=paging.free(pool.pages, rows),
            parked=pool.parked | rows,
            stalled=jnp.zeros_like(pool.stalled),
        )
    )


@functools.partial(runner_jit, static_argnames=("program",), donate_argnames=("state",))
def resume(program: Any, weights: Any, state: Any, slot: jax.Array) -> Any:
    """Give the parked row in `slot` ([] i32) pages again and recompute the keys and values
    of its prompt and generated tokens but the last (which the next step feeds): its prompt
    in a prompt pass, its generated tokens in one decode-kind pass over the buffer's columns
    (as a speculative verification is), so a deterministic runner computes every position
    with the products and sums it had the first time and the row's keys and values come
    back bit for bit."""
    pool = state.pages
    batch = pool.arrival.shape[0]
    rows = jnp.arange(batch) == slot
    prompt_len = state.prompt_len[slot]
    length = prompt_len + state.num_tokens[slot] - 1
    pages, _ = paging.allocate(pool.pages, jnp.where(rows, length, pool.pages.lengths))
    # On a mesh the pass takes one row per data shard, the slot's and a row that writes
    # nothing in each other shard, so each device reads and writes its own pages only.
    per = batch // program.layout.row_multiple
    take = slot % per + per * jnp.arange(program.layout.row_multiple)  # [d]
    real = (take == slot)[:, None]
    cache = attach(state.cache, jnp.where(real, pages.tables[take], paging.NO_PAGE))
    history = state.history.tokens[take]  # [d, P + N]
    width = state.tokens.shape[1]  # N: the generated tokens' buffer
    bucket = history.shape[1] - width  # P >= prompt_len
    cols = jnp.arange(bucket)[None]
    mesh = program.layout.row_mesh
    _, cache = program.runner.forward(
        weights,
        jnp.maximum(history[:, :bucket], 0),
        jnp.where(real & (cols < prompt_len), cols, -1),
        cache,
        prompt=True,
        mesh=mesh,
    )
    cols = prompt_len + jnp.arange(width)[None]
    _, cache = program.runner.forward(
        weights,
        jnp.maximum(jax.lax.dynamic_slice_in_dim(history, prompt_len, width, axis=1), 0),
        jnp.where(real & (cols < length), cols, -1),
        cache,
        mesh=mesh,
    )
    return state.replace(
        cache=detach(cache), pages=pool.replace(pages=pages, parked=pool.parked & ~rows)
    )
