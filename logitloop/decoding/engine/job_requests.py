"""A `generate_many` job's requests on the host: `Request` (one prompt with its own
settings), the rows a request is read into (`_Row`, one per sample, and with guidance one
per negative context, `job_guidance`), the record of a request in flight (`_Pending`),
and the job's bounds read from a sequence of requests (`_bounds_from`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from logitloop.decoding.loop.decode_loop import Outputs
from logitloop.decoding.loop.runner import ModelInfo
from logitloop.decoding.sampling.checks import Widths
from logitloop.decoding.sampling.constraints import HostAutomaton
from logitloop.decoding.sampling.params import DEFAULT_MAX_TOKENS, SamplingParams, canonical_knobs


@dataclasses.dataclass
class Request:
    """One prompt with its own settings.

    prompt: a string (needs a model with a tokenizer) or a list of token ids.
    params: `SamplingParams.create` keyword arguments for this prompt (they replace the
      job's defaults key by key; `max_new_tokens` is `max_tokens`), or a `SamplingParams`
      of batch size 1, or None.
    id: anything; only used to name the request in error messages.
    processors: this request's processors (leaves with a row axis of 1), instead of the
      job's; every request of a job has processors of the same tree structure.
    adapter: its LoRA adapter in the job's `adapters=` by name, None for the job's
      `adapter=` (default the base model), or `(name, source)` to load `source` into the
      table as the job runs (`logitloop.decoding.engine.job_adapters`).
    steer: its steering vectors: an `ll.Steer`, a list of them (`[]`: none), or None for
      the job's `steer=` (`logitloop.decoding.engine.job_steering`).
    guidance_scale, negative_prompt: its classifier-free guidance, as `generate`'s for one
      prompt (None: the job's `guidance_scale=` / `negative_prompt=`; scale 1: unguided);
      each of its rows takes a second slot for its negative row
      (`logitloop.decoding.engine.job_guidance`, docs/guidance.md).
    """

    prompt: Any
    params: Mapping[str, Any] | SamplingParams | None = None
    id: Any = None
    processors: Sequence[Any] | None = None
    adapter: Any = None
    steer: Any = None
    guidance_scale: Any = None
    negative_prompt: Any = None


@dataclasses.dataclass
class _Row:
    """One generated sequence: a request's prompt under one row of its params."""

    request: int  # index of the request in the input
    child: int  # sample index within the request (n > 1)
    ids: list[int]
    params: SamplingParams  # batch size 1
    widths: Widths
    automaton: HostAutomaton | None = None  # its constraint's, compiled
    shard: int = 0  # the block of slots (a mesh's data shard) it is admitted to
    adapter: int = -1  # its LoRA adapter's slot in the job's table (-1: the base)
    steer: tuple = ()  # its steering vectors (`job_steering.JobSteering.resolve`)
    # Classifier-free guidance (`job_guidance`): a guided row's scale; a negative row's
    # flag; the other row of the pair (None: unguided).
    scale: float = 1.0
    negative: bool = False
    partner: Any = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class _Pending:
    """A request admitted from the input and not yet returned."""

    index: int
    ids: list[list[int]]  # per row
    params: SamplingParams  # n rows, EOS ids added (as `generate` has them)
    outputs: list[Outputs | None]  # per row, once it finished: host arrays [1, ...]
    # per row, with `speculative=`: {"cycles", "proposed", "drafted", "accepted"} once it finished
    speculation: list[dict[str, int] | None] | None = None
    captured: list[Any] | None = None  # per row, with `capture=`: `JobCapture.fetch`'s


def _describe(index: int, request_id: Any) -> str:
    return f"requests[{index}]" + ("" if request_id is None else f" (id {request_id!r})")


def _split_request(item: Any) -> Request:
    """Request | (prompt, params) | prompt -> Request."""
    if isinstance(item, Request):
        return item
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and (item[1] is None or isinstance(item[1], (Mapping, SamplingParams)))
    ):
        return Request(item[0], item[1])
    return Request(item)


def _bounds_from(
    info: ModelInfo, items: Sequence[Any], defaults: Mapping[str, Any]
) -> tuple[int, int]:
    """Longest prompt and largest max_tokens of a list of requests (0 when unknown)."""
    longest, most = 1, 1
    for item in items:
        request = _split_request(item)
        prompt, knobs = request.prompt, request.params
        if isinstance(prompt, str):
            if info.tokenizer is None:
                continue  # reported with the request's index later
            length = len(info.tokenizer.encode(prompt))
        else:
            try:
                length = len(prompt)
            except TypeError:
                continue
        if isinstance(knobs, SamplingParams):
            mt = int(np.max(np.asarray(knobs.max_tokens)))
        else:
            try:
                mt = {**defaults, **canonical_knobs(knobs or {})}.get("max_tokens")
                mt = int(np.max(np.asarray(DEFAULT_MAX_TOKENS if mt is None else mt)))
            except (TypeError, ValueError):
                continue  # reported with the request's index later
        longest, most = max(longest, length), max(most, mt)
    return longest, most
