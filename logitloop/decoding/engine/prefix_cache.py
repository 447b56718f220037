"""Shared prompt prefixes on a paged pool: a prompt's full pages are prefilled once and
read by every row that starts with the same tokens (`generate_many(..., prefix_cache=True)`).

A full page of a prompt is named by a key that hashes its tokens and every token before
it (a chain: `key[i] = sha256(key[i - 1] + tokens of page i)`, as vLLM's automatic prefix
caching does), so two prompts share page i exactly when their first `(i + 1) * page_size`
tokens are equal. The host keeps the keys (`PrefixCache`); the pool holds the pages:

- a new row looks up the keys of its prompt's full pages and shares the longest run of
  cached ones (`pages.share`, a reference each); its prefill computes only the tokens
  after them (`host.suffix_batch`), at least its last token, whose logits it samples;
- after the prefill, the row's other full prompt pages are cached: the cache holds a
  reference of its own on each (`pages.retain`), so a page outlives the rows that read it;
- a cached page that no row holds is idle; idle pages are evicted, least recently used
  first (deeper pages of a prompt before the pages they follow), when an admission, a
  resumed row or a row's next token needs a page and none is free;
- a preempted row, when it resumes, shares the cached full pages of its prompt (all of
  them: it needs no prompt logits) and recomputes only the rest of its history
  (`pool.resume`); the prompt pages it recomputes are cached again.

Under LoRA adapters (`adapters=`) the keys are salted with the row's adapter (its slot
and how often the job wrote it, `job_adapters.JobAdapters.salt`): a page prefilled under
one adapter is never read by a row under another or the base; under steering, with the
vectors that reached the prompt's tokens (`job_steering.salt`): a steered prompt's pages
are never read by an unsteered row or a row with other vectors.

The `n` rows of a request share their prompt's pages the same way: the first is
prefilled, the others (in a later prefill group) read its pages. With
`prefix_cache=False` the keys are salted with the request's index, so only a request's own
rows share, and its pages leave the cache as soon as no row holds them.

The keys and values of a shared page are those a prefill of the row's whole prompt
writes, and the prefill after them attends them as the last chunks of a chunked prefill
do: under `deterministic=True` a row's results are bit for bit those without sharing
(`test_deterministic.test_chunked_prefill_equals_one_pass` holds the same invariance).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import job_guidance, job_steering
from logitloop.decoding.engine.job_requests import _Row
from logitloop.decoding.engine.paged_batching import PagedBatcher, _cdiv
from logitloop.decoding.loop import pages as paging


def page_keys(ids: Sequence[int], page_size: int, salt: bytes = b"") -> list[bytes]:
    """The keys of the full pages of the prompt `ids`: page i's hashes its tokens and
    every key before it (and `salt`)."""
    keys, key = [], salt
    for start in range(0, len(ids) - page_size + 1, page_size):
        page = np.asarray(ids[start : start + page_size], np.int64).tobytes()
        key = hashlib.sha256(key + page).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """Which pool page holds which cached key, how many rows hold each cached page, and
    the idle ones (held by no row) in least-recently-used order."""

    def __init__(self):
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.users: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: Sequence[bytes], limit: int) -> list[int]:
        """The pages of the longest run of cached keys `keys[:limit]` starts with."""
        pages = []
        for key in keys[:limit]:
            if key not in self.page_of:
                break
            pages.append(self.page_of[key])
        return pages

    def add(self, key: bytes, page: int) -> None:
        self.page_of[key], self.key_of[page], self.users[page] = page, key, 0

    def acquire(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.users[page] += 1
            self.idle.pop(page, None)

    def release(self, pages: Sequence[int]) -> list[int]:
        """Rows no longer hold `pages`; returns those now idle (deepest first)."""
        idle = []
        for page in reversed(pages):
            self.users[page] -= 1
            if self.users[page] == 0:
                self.idle[page] = None
                idle.append(page)
        return idle

    def evict(self, count: int, keep: set[int]) -> list[int]:
        """Up to `count` idle pages, least recently used first, but none in `keep`,
        dropped from the cache."""
        out = []
        for page in list(self.idle):
            if len(out) == count:
                break
            if page not in keep:
                out.append(page)
        for page in out:
            del self.idle[page], self.users[page], self.page_of[self.key_of.pop(page)]
        return out


@functools.partial(jax.jit, static_argnames=("delta",), donate_argnames=("state",))
def _retain(state: Any, pages: jax.Array, delta: int) -> Any:
    """The cache takes (`delta` 1) or drops (-1) a reference on `pages` ([K], -1 padded);
    dropping also clears the rows refused a page (the pages it frees are theirs)."""
    pool = state.pages
    pool = pool.replace(pages=paging.retain(pool.pages, pages, delta))
    if delta < 0:
        pool = pool.replace(stalled=jnp.zeros_like(pool.stalled))
    return state.replace(pages=pool)


class PrefixBatcher(PagedBatcher):
    """A `PagedBatcher` whose rows share their prompts' cached full pages (module
    docstring). `keep=False` (`prefix_cache=False`): only a request's own rows share. On a
    mesh each data shard's pool has its own cache: a cached page lives in one shard and
    only rows admitted to that shard share it.

    `stats` also gets "prompt_tokens" (the admitted rows' prompt tokens), "prefill_tokens"
    (those the prefills computed; resumed rows' recomputation not counted),
    "cached_tokens" (read from shared pages instead), "evicted_pages" and
    "resume_cached_tokens" (prompt tokens preempted rows read from the cache when they
    resumed, instead of recomputing them)."""

    def __init__(self, plan: Any, *, keep: bool = True, **kwargs: Any):
        super().__init__(plan, **kwargs)
        self.keep = keep
        self.caches = [PrefixCache() for _ in range(self.shards)]
        self.entries = self.plan.program.pool.entries
        self.num_pages = self.plan.program.pool.num_pages
        self.holding: dict[int, list[int]] = {}  # slot -> the cached pages its row holds
        self.protect: set[int] = set()  # pages rows being admitted will share
        self.counted: set[tuple[int, bytes]] = set()  # (shard, key) admissible counted
        self.doomed: list[tuple[int, int]] = []  # (shard, idle page) to drop (keep=False)
        self.stats.update(
            prompt_tokens=0, prefill_tokens=0, cached_tokens=0, evicted_pages=0,
            resume_cached_tokens=0,
        )  # fmt: skip

    def _keys(self, row: _Row) -> list[bytes]:
        salt = b"" if self.keep else row.request.to_bytes(8, "little")
        if self.adapters is not None:  # pages are keyed by the adapter they were made under
            salt += self.adapters.salt(row.adapter)
        salt += job_steering.salt(row.steer)  # and by the vectors that reached the prompt
        salt += job_guidance.salt(row)  # a negative context's apart from prompts'
        return page_keys(row.ids, self.page_size, salt)

    def _limit(self, row: _Row) -> int:
        """Pages a row may share: its last prompt token is always computed (its logits)."""
        return (len(row.ids) - 1) // self.page_size

    def _send(self, pages: list[int], delta: int) -> None:
        if pages:
            padded = np.full((self.num_pages,), paging.NO_PAGE, np.int32)
            padded[: len(pages)] = pages
            self.state = _retain(self.state, padded, delta)

    # ------------------------------------------------------------------ hooks

    def admissible(self, waiting: Sequence[_Row], free: list[int], occupant: dict) -> int:
        self.counted, self.protect = set(), set()
        return super().admissible(waiting, free, occupant)

    def pages_needed(self, row: _Row, shard: int) -> int:
        keys = self._keys(row)
        depth = len(self.caches[shard].match(keys, self._limit(row)))
        while depth < self._limit(row) and (shard, keys[depth]) in self.counted:
            depth += 1  # a row admitted before it in this round writes that page
        return _cdiv(len(row.ids), self.page_size) - depth

    def claim(self, row: _Row, shard: int) -> None:
        keys = self._keys(row)
        self.protect.update(self.caches[shard].match(keys, self._limit(row)))
        self.counted.update((shard, key) for key in keys)

    def room(self, pages: int, shard: int) -> bool:
        short = pages - self.free_pages[shard]
        if short > 0 and short <= self._idle(shard):
            self._evict(short, shard)
        return pages <= self.free_pages[shard]

    def relieve(self, shard: int) -> bool:
        return self._evict(self.slots // self.shards, shard) > 0  # a page for each row

    def vacate(self, slot: int) -> int:
        shard = self.shard_of(slot)
        held = self.holding.pop(slot, [])
        idle = self.caches[shard].release(held)
        if not self.keep:
            self.doomed += [(shard, page) for page in idle]
        return len(held)

    def cached_prompt(self, row: _Row, shard: int) -> list[int]:
        # Every full prompt page: a resumed row needs no prompt logits. Kept from eviction
        # while its resumption (with its partner's, `job_guidance`) makes room.
        shared = self.caches[shard].match(self._keys(row), len(row.ids) // self.page_size)
        self.protect |= set(shared)
        return shared

    def resume(self, occupant: dict) -> None:
        super().resume(occupant)
        self.protect = set()

    def resumed(self, slot: int, row: _Row, shared: list[int]) -> None:
        cache = self.caches[self.shard_of(slot)]
        cache.acquire(shared)
        table = np.asarray(jax.device_get(self.state.pages.pages.tables[slot]))
        held = list(shared)
        self._send(self._cache_pages(cache, self._keys(row), held, len(row.ids), table), 1)
        self.holding[slot] = held
        self.stats["resume_cached_tokens"] += len(shared) * self.page_size

    def _cache_pages(
        self, cache: Any, keys: list[bytes], held: list[int], length: int, table: np.ndarray
    ) -> list[int]:
        """Cache in `cache` (a shard's) the full pages of a prompt of `length` tokens after
        those the row `held`s (`table`: its page table), up to the first another row cached
        first; the row holds them too (appended to `held`). Returns the new ones."""
        new = []
        for j in range(len(held), length // self.page_size):
            if keys[j] in cache.page_of:
                break
            page = int(table[j])
            cache.add(keys[j], page)
            cache.acquire([page])
            held.append(page)
            new.append(page)
        return new

    def _idle(self, shard: int) -> int:
        """Cached pages of `shard` no row holds or is about to share."""
        return sum(page not in self.protect for page in self.caches[shard].idle)

    def _evict(self, count: int, shard: int) -> int:
        pages = self.caches[shard].evict(count, self.protect)
        self._send(pages, -1)
        self.free_pages[shard] += len(pages)
        self.stats["evicted_pages"] += len(pages)
        return len(pages)

    def done(self, occupant: dict) -> np.ndarray:
        done = super().done(occupant)
        doomed, self.doomed = self.doomed, []
        for shard in range(self.shards):
            count = sum(s == shard for s, _ in doomed)
            if count:
                pages = self.caches[shard].evict(count, set())
                self._send(pages, -1)
                self.free_pages[shard] += len(pages)
        return done

    # ------------------------------------------------------------------ admission

    def groups(self, rows: Sequence[_Row]) -> Iterator[list[_Row]]:
        """Prefill groups in which no row reads a page another row of the group writes:
        such a row starts the next group, after the pages it reads are cached."""
        group: list[_Row] = []
        written: set[tuple[int, bytes]] = set()

        def unwritten(row: _Row) -> list[bytes]:  # keys of the pages its prefill writes
            keys = self._keys(row)[: self._limit(row)]
            return keys[len(self.caches[row.shard].match(keys, len(keys))) :]

        # A guided row and its negative row (`job_guidance.units`) stay in one group: their
        # keys differ (`job_guidance.salt`), so neither reads a page the other writes.
        for unit in job_guidance.units(rows):
            reads = [(row.shard, keys[0]) for row in unit if (keys := unwritten(row))]
            if self.full(group, unit) or any(read in written for read in reads):
                yield group
                group, written = [], set()
            group += unit
            written.update((row.shard, key) for row in unit for key in unwritten(row))
        if group:
            yield group
        self.protect = set()

    def admit_group(self, group: list, slot: np.ndarray, shared: Any = None) -> None:
        ps = self.page_size
        real = [i for i, row in enumerate(group) if row is not None]
        keys = {i: self._keys(group[i]) for i in real}
        matches = {
            i: self.caches[group[i].shard].match(keys[i], self._limit(group[i])) for i in real
        }
        table = np.full((self.group, self.entries), paging.NO_PAGE, np.int32)
        for i in range(self.group):
            pages = matches.get(i, matches[real[0]])  # a dummy row repeats the first
            table[i, : len(pages)] = pages
        # A group that shares nothing is prefilled at the job's prompt bucket, as without a
        # cache (one program); one that shares, at the bucket of its longest rest.
        super().admit_group(group, slot, table if any(matches.values()) else None)
        tables = self.plan.layout.host_view(self.state.pages.pages.tables)
        tables = np.asarray(jax.device_get(tables))
        new = []
        for i in real:
            row, cache = group[i], self.caches[group[i].shard]
            held = list(matches[i])
            cache.acquire(held)
            new += self._cache_pages(cache, keys[i], held, len(row.ids), tables[slot[i]])
            self.holding[int(slot[i])] = held
            self.stats["prompt_tokens"] += len(row.ids)
            self.stats["cached_tokens"] += len(matches[i]) * ps
            self.stats["prefill_tokens"] += len(row.ids) - len(matches[i]) * ps
        self._send(new, 1)
