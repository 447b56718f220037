"""A `generate_many` job's LoRA adapters (docs/lora.md): each request's adapter resolved to
a slot of the job's table (`ll.Adapters`) when the request is read, adapters that requests
bring loaded into the table while the job runs, the slots' adapters as the loop's
`ll.Rows`, and the salt that keys a row's prefix-cache pages by its adapter.

A request names its adapter (`Request.adapter`) as

- a name loaded in the table, or None: the job's `adapter=` (None: the base model);
- a pair `(name, source)`: `source` (a PEFT adapter folder, or its tensors and config as
  `(tensors, config)`) is loaded as `name` into the table when the first request naming
  it is read; later requests may name it alone.

Loading writes the table's values only (its shapes are fixed), so nothing compiles, and
the slots other adapters hold are untouched: a row in flight keeps its adapter. A name
already loaded is never replaced in a running job (its rows would change weights
mid-sequence): a pair naming it runs the loaded adapter. An adapter goes into a free slot,
else into the slot of the least recently used adapter that a request brought and no row
of the job holds now (waiting, running or preempted), evicted (a later request naming
it, alone or in a pair, loads it again from its source); the adapters of the table the
job was given and its `adapter=` are never evicted. When every slot is held, the request
is refused with its index, like any bad request.

Pages of the prefix cache are keyed by the adapter's slot and how many times the job
wrote that slot (`salt`), so a prompt's pages prefilled under one adapter are never read
by a row under another or the base, and a slot written again never serves its old pages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from logitloop.models.adapters import Adapters
from logitloop.models.kv import Rows


def _pair(adapter: Any) -> bool:
    return isinstance(adapter, tuple) and len(adapter) == 2 and isinstance(adapter[0], str)


def check(adapter: Any, has_table: bool) -> None:
    """A request's `adapter` has one of the forms of the module docstring."""
    if not (adapter is None or isinstance(adapter, str) or _pair(adapter)):
        raise ValueError(
            f"adapter must be an adapter's name, None (the job's adapter=), or a pair "
            f"(name, source) to load, got {adapter!r}"
        )
    if adapter is not None and not has_table:
        raise ValueError(
            f"adapter={adapter if isinstance(adapter, str) else adapter[0]!r} needs the job's "
            "adapters= (an ll.Adapters: ll.load_adapter(model, ...), or "
            "ll.Adapters.create(model) for adapters the requests bring)"
        )


def _load(table: Adapters, name: str, source: Any) -> Adapters:
    """`table` with `source` (a folder, tensors, or `(tensors, config)`) loaded as `name`."""
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping):
        return table.load(source[0], name=name, config=source[1])
    return table.load(source, name=name)


def check_job_adapter(adapter: Any) -> None:
    """`generate_many`'s `adapter=`: one name (or None) for every request."""
    if adapter is not None and not isinstance(adapter, str):
        raise ValueError(
            f"adapter= of generate_many is one adapter's name (or None) for the requests that "
            f"name none; give each request's with Request(prompt, adapter=name), got "
            f"{adapter!r}"
        )


class JobAdapters:
    """The job's table and each batch slot's adapter (host side; module docstring)."""

    def __init__(self, table: Adapters, default: str | None, slots: int):
        if default is not None:
            table.slot(default, "adapter")  # the job's default is loaded
        self.table = table
        self.default = default
        self.of_slot = np.full((slots,), -1, np.int32)  # each batch slot's table slot
        self.writes = [0] * table.max_adapters  # times the job wrote each table slot
        self.users = [0] * table.max_adapters  # the job's rows that hold each table slot
        self.used = [0] * table.max_adapters  # when each table slot was last resolved
        self.sources: dict[str, Any] = {}  # adapters requests brought: evictable

    def resolve(self, adapter: Any, rows: int = 1) -> int:
        """The table slot (-1: the base) of a request's `adapter` for its `rows` rows,
        which hold it until each is `finished`; a brought adapter not in the table is
        loaded (module docstring)."""
        check(adapter, True)
        if adapter is None:
            adapter = self.default
        if adapter is None:
            return -1
        name, source = (adapter, None) if isinstance(adapter, str) else adapter
        if name not in self.table.names:
            if source is None and name not in self.sources:
                self.table.slot(name, "adapter")  # raises, naming the loaded ones
            self._load(name, self.sources.get(name) if source is None else source)
        slot = self.table.names.index(name)
        self.users[slot] += rows
        self.used[slot] = max(self.used) + 1
        return slot

    def _load(self, name: str, source: Any) -> None:
        """`source` loaded as `name` into a free slot, or the least recently used idle
        brought adapter's (evicted)."""
        if None not in self.table.names:
            idle = [
                s for s, held in enumerate(self.users)
                if held == 0 and self.table.names[s] in self.sources
            ]  # fmt: skip
            if not idle:
                raise ValueError(
                    f"adapter {name!r}: the adapter table is full (max_adapters="
                    f"{self.table.max_adapters}: {', '.join(self.table.loaded)}), and every "
                    "adapter in it is one the job was given or one a waiting or running row "
                    "holds: make the table with a larger max_adapters (ll.Adapters.create)"
                )
            self.table = self.table.remove(self.table.names[min(idle, key=self.used.__getitem__)])
        self.table = _load(self.table, name, source)
        self.writes[self.table.names.index(name)] += 1  # the slot's old pages: not its
        self.sources[name] = source

    def finished(self, slot: int) -> None:
        """A row under table slot `slot` finished: it no longer holds the slot."""
        if slot >= 0:
            self.users[slot] -= 1

    def check_requests(self, adapters: Sequence[Any], describe: Any) -> None:
        """Before any work, for a sequence of requests (their `adapter`s, in order):
        every name loaded or brought by a pair before it. (Whether a slot is free when
        a request is read depends on the rows then running: checked then.)
        `describe(index)` names a request in the error."""
        known = set(self.table.loaded)
        for index, adapter in enumerate(adapters):
            try:
                check(adapter, True)
                adapter = self.default if adapter is None else adapter
                if isinstance(adapter, str) and adapter not in known:
                    self.table.slot(adapter, "adapter")  # raises, naming the loaded ones
                if _pair(adapter):
                    known.add(adapter[0])
            except ValueError as e:
                raise ValueError(f"{describe(index)}: {e}") from None

    def admitted(self, batch_slots: np.ndarray, table_slots: Sequence[int]) -> None:
        """Rows of `table_slots` took `batch_slots` (a dummy's slot, out of range, drops)."""
        for where, slot in zip(batch_slots, table_slots, strict=True):
            if where < len(self.of_slot):
                self.of_slot[where] = slot

    def rows(self) -> Rows:
        """The batch slots' adapters over the job's table, placed from the host."""
        return Rows(jax.device_put(np.asarray(self.of_slot)), self.table.table)

    def salt(self, slot: int) -> bytes:
        """What keys the prefix-cache pages of a row under table slot `slot`."""
        return b"" if slot < 0 else f"lora:{slot}:{self.writes[slot]}|".encode()


def for_job(options: Any, slots: int) -> JobAdapters | None:
    """The adapters of a job of `slots` batch slots under `options` (`plan.Options`), or
    None without `adapters=`."""
    if options.adapters is None:
        return None
    return JobAdapters(options.adapters, options.adapter, slots)


def names(job: JobAdapters | None) -> tuple[str | None, ...] | None:
    """The adapter in each slot of the job's table (None without adapters)."""
    return None if job is None else tuple(job.table.names)


def slot_of(job: JobAdapters | None, adapter: Any, rows: int) -> int:
    """A request's adapter's table slot for its `rows` rows (`JobAdapters.resolve`; -1:
    the base)."""
    if job is None:
        check(adapter, has_table=False)
        return -1
    return job.resolve(adapter, rows)


def finished(job: JobAdapters | None, slot: int) -> None:
    """A row under table slot `slot` finished (`JobAdapters.finished`)."""
    if job is not None:
        job.finished(slot)


def group_rows(job: JobAdapters | None, table_slots: Sequence[int]) -> Rows | None:
    """A prefill group's adapters (`[G]` table slots; the table is the job's, given in
    `batcher._admit`), or None without adapters."""
    if job is None:
        return None
    return Rows(jax.device_put(np.asarray(table_slots, np.int32)))


def request_adapter(item: Any) -> Any:
    """A request's own `adapter` (None for a bare prompt or a pair)."""
    return getattr(item, "adapter", None)
