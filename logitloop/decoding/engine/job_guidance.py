"""A `generate_many` job's classifier-free guidance (docs/guidance.md): a request's
`guidance_scale=` and `negative_prompt=` checked as `generate` checks a prompt's
(`guidance.guided_prompts`), its negative rows, and the slots' `Guidance` tables.

A guided request of `n` samples is read into `2n` rows (`rows`): each sample's row and,
right after it, its negative row (the negative prompt under a copy of the sample's
params, so it stops with it), the pair linked by `_Row.partner`. A pair is one unit of
the batcher: admitted together into two free slots (`whole`, `units`: never split
between two admissions or two prefill groups, so the prefill draws the guided row's first
token from both rows' logits), preempted and resumed together by a paged pool
(`JobGuidance.unit`), and freed together (the negative row finishes with its row,
`loop.guidance.follow_finish`; its output is dropped). Inside the loop a pair also steps
together: a row refused a page holds its partner back (`loop.guidance.together`).

The slots' tables (`JobGuidance`: each slot's scale, negative slot and parent slot) are
data the host writes at each admission: a job compiles the guided loop's programs once,
at its first guided admission (the tables then stay, identity for unguided slots), and
a job whose requests change scales or negative prompts compiles nothing more. A job
where no request is guided carries no tables and runs the plain programs.

On a prefix cache a negative row's pages are keyed apart from every real row's
(`salt`): a negative context shares pages only with other negative contexts of the same
tokens (under the same adapter), never with a prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import guidance as guided
from logitloop.decoding.engine import job_steering
from logitloop.decoding.engine.host import tokenize_prompt
from logitloop.decoding.loop.guidance import Guidance


def request_guidance(request: Any, options: Any) -> tuple[Any, Any]:
    """A request's `(guidance_scale, negative_prompt)`: its own, or the job's for a
    setting it gives none of."""
    scale = getattr(request, "guidance_scale", None)
    negative = getattr(request, "negative_prompt", None)
    return (
        options.guidance_scale if scale is None else scale,
        options.negative_prompt if negative is None else negative,
    )


def check_job(options: Any) -> None:
    """The job's `guidance_scale=` and `negative_prompt=` are every request's defaults:
    one value each, not one per prompt."""
    if isinstance(options.guidance_scale, (list, tuple, np.ndarray)):
        raise ValueError(
            "guidance_scale= of generate_many is every request's default: one number "
            "(a request's own: ll.Request(prompt, guidance_scale=...))"
        )
    if not guided._is_one_prompt(options.negative_prompt):
        raise ValueError(
            "negative_prompt= of generate_many is every request's default: one negative "
            "prompt (a request's own: ll.Request(prompt, negative_prompt=...))"
        )


def any_guided(requests: Any, options: Any) -> bool:
    """Whether the job may guide a request: its own settings, or a sequence's requests'."""
    if options.guidance_scale is not None:
        return True
    if not isinstance(requests, Sequence):
        return False
    return any(getattr(r, "guidance_scale", None) is not None for r in requests)


def longest_negative(info: Any, requests: Any, options: Any) -> int:
    """The longest negative prompt of a sequence of requests (0: none known), for the
    job's prompt bound (a bad one is refused with its request's index when it is read)."""
    longest = 0
    for request in requests if isinstance(requests, Sequence) else ():
        scale, negative = request_guidance(request, options)
        if scale is None or negative is None:
            continue
        try:
            longest = max(longest, len(tokenize_prompt("negative_prompt", negative, info)))
        except (ValueError, TypeError):
            continue
    return longest


def rows(batcher: Any, request: Any, ids: list[int], params: Any, real: list) -> list:
    """The rows of a request (`real`: its `n` rows, prompt `ids`, `params` of `n` rows)
    with each guided sample's negative row after it (the module docstring); `real` as
    it is when the request is not guided. Refused by name: what `generate` refuses,
    a negative prompt over the job's `max_prompt_len`, and a `prefill_batch` that cannot
    prefill a pair. A negative row runs under its row's adapter and steering; under
    `capture=` its states are never read back."""
    plan = batcher.plan
    scale, negative = request_guidance(request, plan.options)
    guided.check_supported(
        dataclasses.replace(plan.options, guidance_scale=scale, negative_prompt=negative), True
    )
    guide = guided.guided_prompts(batcher.info, [ids], scale, negative, params.take([0]))
    if guide is None:
        return real
    neg = guide.negatives[0]
    if len(neg) > batcher.max_prompt_len:
        raise ValueError(
            f"negative_prompt has {len(neg)} tokens, over max_prompt_len = {batcher.max_prompt_len}"
        )
    if batcher.slots // batcher.shards < 2:
        raise ValueError(
            f"a guided request needs 2 slots (its row and its negative row), got slots = "
            f"{batcher.slots}" + (f" over {batcher.shards} shards" if batcher.shards > 1 else "")
        )
    if batcher.group // batcher.shards < 2:
        raise ValueError(
            f"a guided request needs prefill_batch >= 2 (its row and its negative row are "
            f"prefilled together), got prefill_batch = {batcher.group}: pass prefill_batch=2"
        )
    # Its row's steering, its spans counted in its own context (as `generate` steers it).
    batcher.steering, steer = job_steering.resolve(
        batcher.steering, plan, batcher.slots, request.steer, len(neg)
    )
    out = []
    for row in real:
        negative_row = dataclasses.replace(
            row, ids=list(neg), steer=steer, negative=True, partner=row
        )
        row.scale, row.partner = guide.scales[0], negative_row
        out += [row, negative_row]
    return out


def units(rows: Sequence[Any]) -> Iterator[list[Any]]:
    """`rows` as the batcher's units: a guided row with its negative row (which follows
    it), every other row alone."""
    i = 0
    while i < len(rows):
        size = 2 if rows[i].partner is not None and not rows[i].negative else 1
        unit = list(rows[i : i + size])
        if unit[-1] is not (rows[i].partner or rows[i]):
            raise AssertionError("a guided row without its negative row (a split pair)")
        yield unit
        i += size


def whole(rows: Sequence[Any], count: int) -> int:
    """`count`, less one where the first `count` of `rows` would split a pair."""
    if 0 < count < len(rows) and rows[count - 1].partner is rows[count]:
        return count - 1
    return count


def salt(row: Any) -> bytes:
    """A prefix-cache key's salt for `row`: negative contexts apart from prompts."""
    return b"negative|" if row.negative else b""


class JobGuidance:
    """The slots' guidance: host arrays written at admission, the loop's `Guidance` [S]."""

    def __init__(self, slots: int):
        self.scale = np.ones(slots, np.float32)
        self.negative = np.arange(slots, dtype=np.int32)
        self.parent = np.arange(slots, dtype=np.int32)

    def admitted(self, group: Sequence[Any], slot: np.ndarray) -> Guidance:
        """The rows of a prefill `group` (`[G]`, None for a dummy) took `slot` (`[G]`):
        the slots' tables are theirs; returns the group's own `Guidance` [G] (a pair is
        always in one group)."""
        where = {id(row): i for i, row in enumerate(group) if row is not None}
        size = len(group)
        scale = np.ones(size, np.float32)
        negative = np.arange(size, dtype=np.int32)
        parent = negative.copy()
        for i, row in enumerate(group):
            if row is not None and row.partner is not None and not row.negative:
                j = where[id(row.partner)]
                scale[i], negative[i], parent[j] = row.scale, j, i
        for i, row in enumerate(group):
            if row is not None:
                s = int(slot[i])
                self.scale[s] = scale[i]
                self.negative[s] = slot[negative[i]]
                self.parent[s] = slot[parent[i]]
        return Guidance(*jax.device_put((scale, negative, parent)))

    def tables(self) -> Guidance:
        """The loop's `Guidance` of the slots."""
        return Guidance(*jax.device_put((self.scale, self.negative, self.parent)))

    def unit(self, slot: int) -> list[int]:
        """`slot` and the slot of its row's partner, if guided (preempted together)."""
        other = int(self.negative[slot]) if self.negative[slot] != slot else int(self.parent[slot])
        return [slot] if other == slot else [slot, other]

    def freed(self, slot: int) -> None:
        """The row in `slot` finished: the slot is unguided again."""
        self.scale[slot], self.negative[slot], self.parent[slot] = 1.0, slot, slot


def admitted(job: JobGuidance | None, group: Sequence[Any], slot: np.ndarray):
    """`JobGuidance.admitted`, or None for a job that guided no row yet."""
    return None if job is None else job.admitted(group, slot)
