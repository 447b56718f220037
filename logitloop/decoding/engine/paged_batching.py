"""`generate_many(..., kv_cache_tokens=N, page_size=16)`: the slots share one pool of
`N // page_size` pages (`logitloop.decoding.loop.pool`), so the job holds at most N tokens
of keys and values whatever `slots` is, and the slots can outnumber the rows a contiguous
cache of the same memory holds.

The host side of the pool, on top of `batcher._Batcher`:

- a request is admitted when its prompt's pages, plus a reserve of a page while other rows
  run, are free (the host tracks free pages from the count it reads with `done` after
  each chunk, less what it admitted since);
- a finished row's pages return to the pool inside the loop, at once;
- when a running row is refused a page the chunk ends and the newest running row is
  preempted (`pool.park`): it keeps its slot and its sampling state and is resumed, before
  any new request is admitted, when its prompt and generated tokens fit again
  (`pool.resume` recomputes their keys and values, but for the prompt's pages a prefix
  cache holds, which it reads), with the same tokens it would have drawn without
  preemption (its noise is keyed by (seed, position)).

A request that alone needs more than N tokens raises `ValueError` before any work when the
requests are a sequence (else when it is read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import job_guidance
from logitloop.decoding.engine.batcher import _Batcher
from logitloop.decoding.engine.host import MIN_BUFFER_BUCKET, MIN_PROMPT_BUCKET, bucket
from logitloop.decoding.engine.job_requests import _bounds_from, _describe, _Row
from logitloop.decoding.engine.plan import Plan
from logitloop.decoding.loop import pages as paging
from logitloop.decoding.loop import pool
from logitloop.decoding.loop.runner import OWN_CACHE_REFUSAL, ModelInfo

RESERVE_PAGES = 1  # free pages a new or resumed row leaves for each running row's growth


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_pool(kv_cache_tokens: Any, page_size: Any, shards: int = 1) -> tuple[int, int]:
    """The pool's size in tokens and its page size, checked: `(num_pages, page_size)`.
    `shards`: the mesh's data-axis size; the pool is one pool per data shard, so
    `kv_cache_tokens` must split into them in whole pages."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise ValueError(f"page_size must be an int, got {page_size!r}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size = {page_size} must be a positive power of two")
    if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, (int, np.integer)):
        raise ValueError(f"kv_cache_tokens must be an int, got {kv_cache_tokens!r}")
    if kv_cache_tokens < page_size:
        raise ValueError(
            f"kv_cache_tokens = {kv_cache_tokens} is under one page (page_size = {page_size})"
        )
    step = shards * page_size
    if shards > 1 and kv_cache_tokens % step:
        below = kv_cache_tokens // step * step
        near = f"{below} or {below + step}" if below else f"{step}"
        raise ValueError(
            f"kv_cache_tokens = {kv_cache_tokens} does not split into the mesh's data axis "
            f"of {shards} shards (one pool each) in whole pages of page_size = {page_size}: "
            f"give a multiple of {step} (e.g. {near})"
        )
    return int(kv_cache_tokens) // int(page_size), int(page_size)


def tokens_needed(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """Tokens of KV a row of this prompt and max_tokens may hold at most, in whole pages
    (every token but the last is fed back)."""
    return _cdiv(prompt_len + max_tokens - 1, page_size) * page_size


def _too_long(
    name: str, prompt_len: int, max_tokens: int, kv_cache_tokens: int, ps: int, shards: int
):
    need = tokens_needed(prompt_len, max_tokens, ps)
    if need > kv_cache_tokens // ps // shards * ps:
        where = "" if shards == 1 else f" / {shards} data shards (a row holds pages of one)"
        raise ValueError(
            f"{name} needs {need} tokens of KV cache (a prompt of {prompt_len} tokens and "
            f"max_tokens = {max_tokens}, in pages of {ps}), over kv_cache_tokens = "
            f"{kv_cache_tokens}{where}"
        )


def check_requests(
    info: ModelInfo,
    requests: Sequence[Any],
    defaults: Mapping[str, Any],
    kv_cache_tokens: int,
    page_size: int,
    shards: int = 1,
) -> None:
    """Before any work: every request of a sequence fits the pool (a shard's) alone."""
    for index, item in enumerate(requests):
        length, most = _bounds_from(info, [item], defaults)
        name = _describe(index, getattr(item, "id", None))
        _too_long(name, length, most, kv_cache_tokens, page_size, shards)


class PagedBatcher(_Batcher):
    """`_Batcher` whose slots share one paged pool (the module docstring); on a mesh one
    pool per data shard, each serving that shard's block of slots.

    `stats` (a dict, filled as the job runs): "preemptions", "resumed",
    "most_rows_in_flight" (rows holding pages at once, at the admission points) and
    "most_pages_held" (pages held at the end of a chunk, the most seen, one count per layer
    group: the main group first, `pool.PoolShape.groups`)."""

    def __init__(
        self, plan: Plan, *, kv_cache_tokens: int, page_size: int, stats: dict, **kwargs: Any
    ):
        super().__init__(plan, **kwargs)
        self.shards = plan.layout.row_multiple
        num_pages, _ = check_pool(kv_cache_tokens, page_size, self.shards)
        self.kv_cache_tokens = kv_cache_tokens
        self.page_size = page_size
        entries = _cdiv(self.prompt_len + self.buffer_len, page_size)
        windows = plan.info.runner.sliding_windows(plan.info.weights)
        shape = pool.shape_for(windows, num_pages, page_size, entries, self.slots)
        shape = dataclasses.replace(shape, shards=self.shards)
        self.plan = dataclasses.replace(plan, program=dataclasses.replace(plan.program, pool=shape))
        # The host's view of each shard's free pages: the last count read, less admissions.
        self.free_pages = np.full(self.shards, num_pages // self.shards, np.int64)
        # The same for each further layer group (`pool.PoolShape.groups`; empty without; a
        # pool with layer groups has one shard, `pool_refusal`).
        self.group_free = np.array([n for _, n in shape.groups], np.int64)
        self.arrival: dict[int, int] = {}  # slot -> admission number
        self.arrivals = 0
        self.parked: set[int] = set()
        self.held = np.zeros(self.slots, np.int64)  # tokens each slot held at the last read
        self.stalled = False
        self.stats = stats
        self.group_pages = np.array([num_pages, *self.group_free], np.int64)
        stats.update(preemptions=0, resumed=0, most_rows_in_flight=0)
        stats.update(most_pages_held=[0] * len(self.group_pages))

    def prepare(self, index: int, item: Any) -> tuple[Any, list[_Row]]:
        pending, rows = super().prepare(index, item)
        name = _describe(index, getattr(item, "id", None))
        for row in rows:
            most = int(np.asarray(row.params.max_tokens)[0])
            _too_long(name, len(row.ids), most, self.kv_cache_tokens, self.page_size, self.shards)
        for unit in job_guidance.units(rows):  # a guided row and its negative row, at once
            ps, most = self.page_size, int(np.asarray(unit[0].params.max_tokens)[0])
            need = sum(tokens_needed(len(row.ids), most, ps) for row in unit)
            if need > self.kv_cache_tokens // ps // self.shards * ps:
                raise ValueError(
                    f"{name}: its row and its negative row need {need} tokens of KV cache "
                    f"together (max_tokens = {most}, in pages of {ps}), over "
                    f"kv_cache_tokens = {self.kv_cache_tokens}"
                )
        return pending, rows

    def shard_of(self, slot: int) -> int:
        """The data shard (block of slots, pool) of `slot`."""
        return slot // (self.slots // self.shards)

    # Hooks of a prefix cache (`prefix_cache.PrefixBatcher`); without one, a row's prompt
    # takes new pages and nothing else holds pages.

    def pages_needed(self, row: _Row, shard: int) -> int:
        """New pages the prompt of `row` takes when it is admitted to `shard`."""
        return _cdiv(len(row.ids), self.page_size)

    def claim(self, row: _Row, shard: int) -> None:
        """`row` is admitted to `shard` (a prefix cache keeps the pages it will share)."""

    def room(self, pages: int, shard: int) -> bool:
        """Whether `pages` pages are free in `shard`, in every layer group (a prefix cache
        first evicts pages to free them)."""
        return pages <= self.free_pages[shard] and bool(np.all(pages <= self.group_free))

    def _take(self, pages: int, shard: int) -> None:
        """The host's view after a row took `pages` pages in `shard`, in every layer group."""
        self.free_pages[shard] -= pages
        self.group_free -= pages

    def relieve(self, shard: int) -> bool:
        """Free pages in `shard` for a row refused one mid-chunk without preempting a row;
        whether it did (then the stalled rows run on at the next chunk)."""
        return False

    def vacate(self, slot: int) -> int:
        """The row in `slot` finished or was preempted: its pages are back in the pool.
        Returns how many of them stay held (by a prefix cache), not free."""
        return 0

    def cached_prompt(self, row: _Row, shard: int) -> list[int]:
        """Pages of `row`'s prompt (its first full pages) in `shard` a resumed row reads
        instead of recomputing them: none without a prefix cache."""
        return []

    def resumed(self, slot: int, row: _Row, shared: list[int]) -> None:
        """The parked row in `slot` holds pages again, `shared` first."""

    def unit(self, slot: int) -> list[int]:
        """`slot`, and its row's partner's slot when the row is guided or a negative row
        (`job_guidance`): preempted and resumed together."""
        return [slot] if self.guidance is None else self.guidance.unit(slot)

    def _running(self, occupant: dict, shard: int) -> int:
        return sum(
            1 for slot in occupant if slot not in self.parked and self.shard_of(slot) == shard
        )

    def admissible(self, waiting: Sequence[_Row], free: list[int], occupant: dict) -> int:
        """As many waiting rows, in order, as free slots and pages hold; each to the shard
        whose pool it needs fewest new pages of (then: the most free pages). A shard with
        a preempted row admits nothing (that row comes first)."""
        blocked = {self.shard_of(slot) for slot in self.parked}
        running = [self._running(occupant, shard) for shard in range(self.shards)]
        open_slots = [
            0 if shard in blocked else sum(self.shard_of(slot) == shard for slot in free)
            for shard in range(self.shards)
        ]
        count = 0
        # A guided row and its negative row (`job_guidance.units`) go to one shard together.
        for unit in job_guidance.units(list(waiting)):  # until the slots or pages run out
            shards = [shard for shard in range(self.shards) if open_slots[shard] >= len(unit)]
            needs = {shard: sum(self.pages_needed(r, shard) for r in unit) for shard in shards}
            shards.sort(key=lambda shard: (needs[shard], -self.free_pages[shard]))
            chosen = next(
                (
                    shard
                    for shard in shards
                    if self.room(needs[shard] + RESERVE_PAGES * running[shard], shard)
                ),
                None,
            )
            if chosen is None:
                break
            for row in unit:
                row.shard = chosen
                self.claim(row, chosen)
            self._take(needs[chosen], chosen)
            open_slots[chosen] -= len(unit)
            running[chosen] += len(unit)
            count += len(unit)
        in_flight = sum(running)
        self.stats["most_rows_in_flight"] = max(self.stats["most_rows_in_flight"], in_flight)
        return count

    def admit(self, rows: Sequence[_Row], free: list[int]) -> list[int]:
        used = super().admit(rows, free)
        for slot in used:
            self.arrival[slot] = self.arrivals
            self.arrivals += 1
        return used

    def resume(self, occupant: dict) -> None:
        if self.stalled:  # the pages just freed are for the row that was refused
            return
        ps = self.page_size
        waits = set()  # shards whose oldest preempted row does not fit yet
        for first in sorted(self.parked, key=self.arrival.__getitem__):
            shard = self.shard_of(first)
            if first not in self.parked or shard in waits:  # resumed with its partner, or
                continue  # its shard's older row waits
            unit = self.unit(first)  # a guided row and its negative row resume together
            shared = [self.cached_prompt(occupant[slot], shard) for slot in unit]
            need = sum(
                _cdiv(int(self.held[s]), ps) - len(p) for s, p in zip(unit, shared, strict=True)
            )
            running = self._running(occupant, shard)
            if not self.room(need + RESERVE_PAGES * running, shard):
                waits.add(shard)
                continue
            for slot, cached in zip(unit, shared, strict=True):
                row = occupant[slot]
                table = np.full((self.plan.program.pool.entries,), paging.NO_PAGE, np.int32)
                table[: len(cached)] = cached
                rest = bucket(max(len(row.ids) - len(cached) * ps, 1), MIN_PROMPT_BUCKET)
                self.state = pool.resume(
                    self.plan.program, self.tables.weights, self.state, np.int32(slot), table,
                    self.tables.rows, width=min(rest, self.prompt_len),
                )  # fmt: skip
                self.resumed(slot, row, cached)
                self.parked.discard(slot)
                self.stats["resumed"] += 1
            self._take(need, shard)

    def done(self, occupant: dict) -> np.ndarray:
        done = super().done(occupant)
        s = self.state
        # Read on the host, counted there: an eager count would be a program of its own.
        stalled, states, num_tokens, prompt_len = jax.device_get(
            self.plan.layout.host_view(
                (s.pages.stalled, s.pages.states(), s.num_tokens, s.prompt_len)
            )
        )
        free, counts = paging.free_by_shard(states[0]), np.asarray(pool.free_counts(states))
        self.free_pages = np.asarray(free, np.int64)
        self.group_free = np.asarray(counts[1:], np.int64)
        most = np.maximum(self.stats["most_pages_held"], self.group_pages - counts)
        self.stats["most_pages_held"] = [int(x) for x in most]
        # A parked row holds, once resumed, its prompt and generated tokens but the last.
        self.held = np.asarray(prompt_len) + np.asarray(num_tokens) - 1
        for slot in occupant:
            if done[slot]:
                self.vacate(slot)
        # Each shard whose row was refused a page frees pages without preempting a row
        # if it can (then its stalled rows run on at the next chunk), else preempts its
        # newest running row.
        short = {self.shard_of(int(slot)) for slot in np.flatnonzero(stalled)}
        short = {shard for shard in short if not self.relieve(shard)}
        self.stalled = bool(short)
        for shard in sorted(short):
            running = [
                slot
                for slot in occupant
                if not done[slot] and slot not in self.parked and self.shard_of(slot) == shard
            ]
            newest = max(running, key=self.arrival.__getitem__)
            for victim in self.unit(newest):  # a guided row's partner goes with it
                tables = jax.device_get([state.tables[victim] for state in s.pages.states()])
                held = np.array([np.sum(table >= 0) for table in tables], np.int64)
                self.state = pool.park(self.state, np.int32(victim))
                self.parked.add(victim)
                kept = self.vacate(victim)  # its pages a prefix cache keeps are not free
                # Its pages held (a window may have released some), less those cached.
                self.free_pages[shard] += int(held[0]) - kept
                self.group_free += held[1:]
                self.stats["preemptions"] += 1
        for slot in occupant:
            if done[slot]:
                self.arrival.pop(slot, None)
        return done


def pool_refusal(job: Plan) -> str | None:
    """Why a paged pool cannot run `job` (a sentence), or None when it can."""
    if job.info.runner.kv_spec is None:
        return OWN_CACHE_REFUSAL.format(what="a paged pool")
    windows = job.info.runner.sliding_windows(job.info.weights)
    if job.options.mesh is not None and len(set(windows)) > 1:
        return "a pool of a page table per window (layers' windows differ) on a mesh is not built"
    return None


def sharing_refusal(job: Plan) -> str | None:
    """Why `job`'s rows cannot share pages (a prefix cache, a request's n rows prefilled
    once), or None when they can. On a mesh rows share within their data shard's pool.
    Speculative decoding shares: a verification writes at the row's positions from its
    prompt's length on, past every shared page (shared pages are full prompt pages), and a
    draft model's own cache is prefilled with the whole prompt
    (`decode_loop.speculation_state`)."""
    return pool_refusal(job)


def prefix_refusal(job: Plan) -> str | None:
    """Why `generate_many`'s rows cannot share pages (`sharing_refusal`), or a model whose
    layers' windows differ: its pool has a page table per layer group (`pool.shape_for`),
    and the prefix cache shares one table's pages only. Its default then stays the
    contiguous slots (their windows are rings); `kv_cache_tokens` gives the grouped pool."""
    refusal = sharing_refusal(job)
    if refusal is None and len(set(job.info.runner.sliding_windows(job.info.weights))) > 1:
        return "pages shared between rows do not work with layers of different windows yet"
    return refusal


def slots_memory(slots: int, max_prompt_len: int, max_tokens: int, page_size: int) -> int:
    """The tokens of KV that `slots` contiguous rows of the job's buckets hold, in whole
    pages: the pool a job without `kv_cache_tokens` gets."""
    row = bucket(max_prompt_len, MIN_PROMPT_BUCKET) + bucket(max_tokens, MIN_BUFFER_BUCKET)
    return slots * _cdiv(row, page_size) * page_size


def batcher(
    job: Plan,
    requests: Any,
    kv_cache_tokens: Any,
    page_size: Any,
    stats: dict,
    factory: Any = PagedBatcher,
    **bounds: Any,
) -> PagedBatcher:
    """A `PagedBatcher` (or what `factory`, a subclass, makes) for `iter_generate_many`,
    every argument checked before any work."""
    shards = job.layout.row_multiple
    check_pool(kv_cache_tokens, page_size, shards)
    refusal = pool_refusal(job)
    if refusal is not None:
        raise ValueError(f"kv_cache_tokens: {refusal}")
    if isinstance(requests, Sequence):
        check_requests(job.info, requests, bounds["defaults"], kv_cache_tokens, page_size, shards)
    return factory(job, kv_cache_tokens=kv_cache_tokens, page_size=page_size, stats=stats, **bounds)
