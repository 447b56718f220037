"""`n > 1` samples of each prompt on a paged pool: the prompt is prefilled once, its n rows
share its full pages and each copies its partial last page (`generate(..., n=16)`).

The batch's rows are prompt-major (`host.request_rows`): rows `u * n .. u * n + n - 1` are
the samples of prompt u, and row `u * n` (the parent) is the one prefilled:

1. each parent takes the pages of its prompt (`pages.allocate`) and the prefill of the
   U distinct prompts writes them (`decode_loop.forward_prompt` through the parents'
   tables);
2. the other rows `fork` their parent's full pages (a reference each; nobody writes a
   full prompt page again), take a page of their own for the partial last page and copy
   the parent's into it (`layers.copy_pages`, copy-on-write), so each row writes only
   its own pages from there on;
3. every row draws its first token from its prompt's logits, with its own params (with
   a draft model, its own contiguous cache is prefilled once per prompt and repeated);
4. the layers are told the groups (`layers.share_prefix`: each prompt's full pages, and
   at most `cdiv(page_size - 1 + buffer_len, page_size)` pages of a row's own after
   them), so each decode step reads a prompt's shared pages once for its n rows
   (`logitloop.ops.attention.paged.cascade_attention`; the deterministic mode keeps its
   fixed-order attention over each row's pages, and a mesh reads each row's table).

The loop then runs as with `generate_many`'s pool (`pool`: rows grow page by page and
return their pages when they finish), in a pool that holds each prompt's pages once and
each row's own pages (`pool_shape`: for 64 rows of a 2K-token prompt and 16 new tokens,
129 + 64 x 2 pages of 16 tokens against the contiguous cache's 64 x 129). On a mesh whose
data axis splits the U prompts, each data shard holds its prompts' n rows and one pool of
their pages (`pages.PageState.shards`). A row's logits are those of its prompt prefilled
alone, so its tokens are those of the same row without sharing (bit for bit under
`deterministic=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from logitloop.decoding.loop import pages as paging
from logitloop.decoding.loop import pool as paged
from logitloop.decoding.loop.decode_loop import (
    DecodeState,
    Program,
    PromptBatch,
    Tables,
    first_state,
    forward_prompt,
    speculation_state,
)
from logitloop.decoding.loop.runner import runner_jit
from logitloop.models import layers


def own_pages(page_size: int, buffer_len: int) -> int:
    """The most pages a row holds after its prompt's full (shared) pages: its partial
    prompt page and its generated tokens', `cdiv(page_size - 1 + buffer_len, page_size)`."""
    return -(-(page_size - 1 + buffer_len) // page_size)


def pool_shape(
    prompts: int, n: int, cache_len: int, page_size: int, buffer_len: int, shards: int = 1
):
    """The pool of `prompts * n` rows of at most `cache_len` tokens that share their
    prompts' full pages: each prompt's pages once and each row's `own_pages`, so no row is
    ever refused a page (at most the contiguous cache's memory; far less for n > 1).
    `shards`: one pool per data shard, each of its prompts' pages (they split evenly)."""
    entries = -(-cache_len // page_size)
    pages = min(prompts * n * entries, prompts * entries + prompts * n * own_pages(
        page_size, buffer_len))  # fmt: skip
    return paged.PoolShape(pages, page_size, entries, shards=shards)


@functools.partial(runner_jit, static_argnames=("program", "n", "buffer_len", "num_top"))
def prefill_forked(
    program: Program,
    tables: Tables,  # [U * n] rows
    prompts: PromptBatch,  # [U] distinct prompts
    fsm: jax.Array | None = None,  # [U * n] i32, the rows' initial automaton states
    *,
    n: int,
    buffer_len: int,
    num_top: int,
) -> DecodeState:
    """The state after prefill of `n` rows per prompt sharing its pages (module docstring);
    `program.pool` sizes the pool."""
    shape = program.pool
    ps = shape.page_size
    unique = prompts.prompt.shape[0]
    batch = unique * n
    cache, pool = paged.init(program.runner, tables.weights, shape, batch)
    rows = jnp.arange(batch)
    parents = rows // n * n
    child = rows != parents
    lengths = jnp.repeat(prompts.lengths, n)
    pages, _ = paging.allocate(pool.pages, jnp.where(child, 0, lengths))
    runner = program.runner
    width = prompts.prompt.shape[1]
    routing = runner.no_routing(tables.weights, unique, width) if program.routing else None
    # A prompt's n rows share its adapter and steering, as they share its pages.
    state_rows = tables.rows
    if state_rows is not None:
        state_rows = state_rows.every(n)
    logits, cache, *used = forward_prompt(
        runner, tables.weights, prompts.prompt, prompts.positions, 0, program.layout,
        cache=paged.attach(cache, pages.tables[::n]), routing=routing, rows=state_rows,
    )  # fmt: skip
    pages = paging.fork(pages, parents, child)
    pages, _ = paging.allocate(pages, lengths)
    last = (lengths // ps)[:, None]  # the partial page's table entry
    source = jnp.take_along_axis(pages.tables[parents], last, axis=1)[:, 0]
    target = jnp.take_along_axis(pages.tables, last, axis=1)[:, 0]
    target = jnp.where(child & (lengths % ps != 0), target, shape.num_pages)  # else skipped
    cache = layers.copy_pages(paged.detach(cache), source, target, program.layout.row_mesh)
    shared_width = prompts.prompt.shape[1] // ps  # the most full pages a prompt has
    if shared_width and program.layout.row_mesh is None:
        cache = layers.share_prefix(
            cache,
            pages.tables[::n, :shared_width],
            prompts.lengths // ps * ps,
            suffix_entries=own_pages(ps, buffer_len),
        )
    state = first_state(
        program.layout,
        tables,
        jnp.repeat(logits, n, axis=0),
        cache,
        jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), prompts.history),
        lengths,
        buffer_len,
        num_top,
        fsm,
    )
    if program.speculative is not None:  # a draft model's own cache: prefilled once too
        spec = speculation_state(program, tables, prompts, buffer_len)
        state = state.replace(speculation=jax.tree.map(lambda x: jnp.repeat(x, n, 0), spec))
    if program.routing:  # each prompt's experts, for each of its n rows
        prompt_routing = jnp.where(prompts.positions[:, :, None, None] >= 0, used[0], -1)
        generated = runner.no_routing(tables.weights, batch, buffer_len)
        state = state.replace(routing=(jnp.repeat(prompt_routing, n, axis=0), generated))
    pool = pool.replace(pages=paging.free(pages, state.done), arrival=rows.astype(jnp.int32))
    return state.replace(pages=pool)
