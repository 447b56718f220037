"""A `generate_many` job's steering vectors (docs/inside.md): each request's `ll.Steer`s
checked when the request is read, the batch slots' vectors as the loop's `ll.Rows.steer`,
and the salt that keys a row's prefix-cache pages by the steering its prompt ran under.

A request gives its steering (`Request.steer`) as an `ll.Steer`, a list of them (several
layers; `[]`: none), or None: the job's `steer=` (one `ll.Steer` or a list of them, for
every request that gives none; default none).

The slots' vectors are host arrays `[S, K, E]` (`inside.steer_arrays`) written when a row
is admitted and placed with the next call, as the slots' adapters are
(`job_adapters.JobAdapters.rows`): new vectors, scales, layers and spans compile nothing.
K, the vectors a row may hold, is a power of two; a request with more widens it (a new
shape: compiles once). A job whose requests are a sequence takes the widest K up front
(`for_job`).

The keys and values of a prompt's full pages depend on the vectors that reach the
prompt's tokens: a "prompt" or "both" vector reaches every one of them (its span starts
at 0, `inside._span`), a "generated" one none. `salt` hashes the former (layer, scale,
vector, in order), so a steered prompt's pages are read only by rows steered the same on
their prompts, never by an unsteered row or one with other vectors; a row steered on its
generated tokens only shares the unsteered pages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import inside, job_adapters
from logitloop.decoding.loop.layout import Layout
from logitloop.models.kv import Rows
from logitloop.models.steering import Steering


def steer_list(steer: Any, name: str) -> list[Any] | None:
    """`steer` (an `ll.Steer`, a list of them, or None) as a list, None for None."""
    if steer is None:
        return None
    if isinstance(steer, inside.Steer):
        return [steer]
    if isinstance(steer, (list, tuple)):
        return list(steer)
    raise ValueError(
        f"{name} must be an ll.Steer, a list of them ([] for none) or None, got "
        f"{type(steer).__name__}"
    )


def request_steer(item: Any) -> Any:
    """A request's own `steer` (None for a bare prompt or a pair)."""
    return getattr(item, "steer", None)


class JobSteering:
    """The job's default steering and each batch slot's vectors (host side; module
    docstring). `width`: the model's residual width (None: a user's model, whose vectors
    must all have the first one's width, its pass checking it when traced)."""

    def __init__(self, default: Any, slots: int, num_layers: int, width: int | None):
        self.default = steer_list(default, "steer=") or []
        if self.default:  # checked before any request is read (its span is per prompt)
            inside.row_steers(self.default, "steer=", 1, num_layers, width)
        self.num_layers = num_layers
        self.width = width
        self.arrays: tuple[np.ndarray, ...] | None = None  # [S, K, E] once E is known
        self.slots = slots
        self.k = 1

    def resolve(self, steer: Any, prompt_len: int) -> tuple[tuple, ...]:
        """A request's steers (its `steer`, module docstring) for its prompt of
        `prompt_len` tokens, checked: `inside.row_steers`' tuples."""
        entries = steer_list(steer, "steer")
        entries = self.default if entries is None else entries
        steers = inside.row_steers(entries, "steer", prompt_len, self.num_layers, self.width)
        if steers and self.width is None:
            self.width = steers[0][0].shape[0]  # a user's model: the first vector's
        self.k = max(self.k, inside.vector_bucket(len(steers)))
        return tuple(steers)

    def _fit(self) -> tuple[np.ndarray, ...]:
        """The slots' arrays at the job's K (widened for a request with more vectors)."""
        e = self.width or 1  # no vector seen yet in a user's model: nothing steers
        if self.arrays is None:
            self.arrays = inside.steer_arrays(self.slots, self.k, e)
        k = self.arrays[0].shape[1]
        if self.k > k or self.arrays[0].shape[2] != e:
            old, self.arrays = self.arrays, inside.steer_arrays(self.slots, self.k, e)
            if old[0].shape[2] == e:
                for new, was in zip(self.arrays, old, strict=True):
                    new[:, :k] = was
        return self.arrays

    def admitted(self, batch_slots: np.ndarray, rows: Sequence[tuple]) -> None:
        """Rows with steers `rows` took `batch_slots` (a dummy's slot, out of range, drops)."""
        arrays = self._fit()
        for where, steers in zip(batch_slots, rows, strict=True):
            if where < self.slots:
                inside.put_steers(arrays, int(where), steers)

    def steering(self) -> Steering:
        """The batch slots' vectors, placed from the host."""
        return Steering(*map(jax.device_put, self._fit()))

    def group(self, rows: Sequence[tuple]) -> Steering:
        """A prefill group's vectors (`[G]` rows' steers)."""
        _, k, e = self._fit()[0].shape
        arrays = inside.steer_arrays(len(rows), k, e)
        for i, steers in enumerate(rows):
            inside.put_steers(arrays, i, steers)
        return Steering(*map(jax.device_put, arrays))


def salt(steers: Sequence[tuple]) -> bytes:
    """What keys the prefix-cache pages of a row with `steers` (`JobSteering.resolve`):
    the vectors that reach its prompt's tokens (module docstring); b"" for none."""
    reach = [(v, layer, scale) for v, layer, scale, start, _ in steers if start == 0]
    if not reach:
        return b""
    h = hashlib.sha256()
    for vector, layer, scale in reach:
        h.update(np.asarray([layer], np.int64).tobytes())
        h.update(np.asarray([scale], np.float32).tobytes())
        h.update(np.ascontiguousarray(vector, np.float32).tobytes())
    return b"steer:" + h.digest() + b"|"


def for_job(plan: Any, slots: int, requests: Any, describe: Any) -> JobSteering | None:
    """The steering of a job of `slots` batch slots under `plan` (`plan.Plan`), or None
    when neither the job's `steer=` nor any of `requests` (when a sequence) steers; a
    request of a generator that steers starts it later (`_Batcher.prepare`). A sequence's
    steers are checked here, before any work (`describe(index, id)` names a request)."""
    steers = [request_steer(item) for item in requests] if isinstance(requests, Sequence) else []
    if plan.options.steer is None and all(s is None for s in steers):
        return None
    job = start(plan, slots)
    for index, steer in enumerate(steers):
        try:
            job.resolve(steer, 1)  # the spans are the prompt's, set when it is read
        except ValueError as e:
            name = describe(index, getattr(requests[index], "id", None))
            raise ValueError(f"{name}: {e}") from None
    return job


def resolve(
    job: JobSteering | None, plan: Any, slots: int, steer: Any, prompt_len: int
) -> tuple[JobSteering | None, tuple]:
    """The job's steering and a request's steers (`JobSteering.resolve`; `()`: none) for
    its `steer` and a prompt of `prompt_len` tokens; a job without steering starts it
    when a request of a generator steers (a new shape for the loop: compiles once)."""
    if steer is not None and job is None:
        job = start(plan, slots)
    return job, () if job is None else job.resolve(steer, prompt_len)


def start(plan: Any, slots: int) -> JobSteering:
    """A job's steering under `plan`, before any request (`for_job`)."""
    return JobSteering(plan.options.steer, slots, plan.num_layers, plan.info.residual_width)


def slot_rows(
    adapters: Any, steering: JobSteering | None, layout: Layout, capture: Any = None
) -> Rows | None:
    """The batch slots' per-row model state: their LoRA adapters (`job_adapters`) and
    steering vectors, placed from the host where `layout` reads them, and the layers they
    capture (`capture`, a `job_capture.JobCapture`); None without any."""
    if adapters is None and steering is None and capture is None:
        return None
    rows = Rows() if adapters is None else adapters.rows()
    rows = rows if capture is None else rows.replace(capture=capture.layers)
    rows = rows if steering is None else rows.replace(steer=steering.steering())
    return layout.place_rows(rows)


def refreshed(
    plan: Any, tables: Any, rows: Rows | None, adapters: Any, steering: Any, capture: Any
) -> tuple[Any, Any]:
    """After an admission whose group's per-row state is `rows` (`admitted`): the job's
    `tables` with the slots' state (the table as loaded so far, the slots' adapters and
    vectors) and, for a draft model with adapters of its own, the slots' draft inputs;
    and the group's draft inputs (None: the draft's own weights serve)."""
    if rows is None:
        return tables, None
    slots = slot_rows(adapters, steering, plan.layout, capture)
    names = job_adapters.names(adapters)
    tables = tables.replace(rows=slots)
    group_draft = plan.own_draft(rows, names)
    if group_draft is not None:
        tables = tables.replace(draft_weights=plan.own_draft(slots, names))
    return tables, group_draft


def admitted(
    adapters: Any,
    steering: JobSteering | None,
    slot: np.ndarray,
    group: Sequence[Any],
    layout: Layout,
) -> Rows | None:
    """The rows of `group` (`batcher._Row`s, dummies repeating the first) took `slot`
    (`[G]`): the slots' adapters and vectors are theirs from now on; returns the group's
    own per-row state for its prefill (`[G]`, placed where `layout` reads it), None
    without adapters or steering."""
    if adapters is None and steering is None:
        return None
    rows = Rows()
    if adapters is not None:
        rows = job_adapters.group_rows(adapters, [r.adapter for r in group])
        adapters.admitted(slot, [r.adapter for r in group])
    if steering is not None:
        steering.admitted(slot, [r.steer for r in group])
        rows = rows.replace(steer=steering.group([r.steer for r in group]))
    return layout.place_rows(rows)
