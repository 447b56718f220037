"""`precompile`: compile a job's bucket set ahead of time, so no request compiles.

    report = ll.precompile(model, rows=[1, 8], prompt_len=[16, 128], max_tokens=64)
    print(report)          # "precompile: 8 programs in 11.2 s (4 buckets; 0 already compiled)"
    ll.generate(model, prompts, max_tokens=40)   # 5 prompts of <= 128 tokens: compiles nothing

A `generate` or `stream` call runs the programs of its buckets (docs/performance.md, "What
compiles"): its rows (`host.row_bucket`), its longest prompt and its largest `max_tokens`
(`host.bucket`), the top-logprob width (0 or 20), `n` and the program's features (stop
strings always, constraints, processors, speculation, a mesh). `precompile` builds, for each
combination of the sizes it is given, the batch such a call would build (dummy prompts of
that length, the sampling settings given) and compiles its prefill and its decode loop with
`jit(...).trace(...).lower(...).compile()`, without running either: a later call whose
sizes fall in the same buckets, with any values, compiles nothing. With JAX's persistent
compilation cache on (`ll.enable_compile_cache()`), the programs are also written there,
so the next process loads them instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine.generate import forked_call, on_pool
from logitloop.decoding.engine.host import check_count, prefill_call
from logitloop.decoding.engine.plan import Options, plan, sampling_params
from logitloop.decoding.loop.decode_loop import decode
from logitloop.decoding.runtime.compiles import ProgramLog, preparing


@dataclasses.dataclass
class PrecompileReport:
    """What `precompile` did: `programs` compiled now, `cached` ones this process had
    already, in `seconds`, for `buckets` ((rows, prompt columns, cache slots) each)."""

    programs: int
    cached: int
    seconds: float
    buckets: list[tuple[int, int, int]]

    def __str__(self) -> str:
        return (
            f"precompile: {self.programs} programs in {self.seconds:.1f} s "
            f"({len(self.buckets)} buckets; {self.cached} already compiled)"
        )


_JOB_ARGUMENTS = ("prefill_batch", "chunk_steps", "kv_cache_tokens", "page_size", "prefix_cache")


def _precompile_job(
    model: Any,
    slots: int,
    prompt_sizes: list[int],
    token_sizes: list[int | None],
    progress: bool,
    keywords: dict[str, Any],
) -> PrecompileReport:
    """`precompile(slots=...)`: a `generate_many` job of each size, one request each."""
    from logitloop.decoding.engine.batching import Request, generate_many

    job = {k: keywords.pop(k) for k in _JOB_ARGUMENTS if k in keywords}
    options, settings = Options.split("precompile", keywords)
    shared = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    started, buckets = time.perf_counter(), []
    with ProgramLog() as log:
        for i, (p, m) in enumerate(itertools.product(prompt_sizes, token_sizes)):
            total = len(prompt_sizes) * len(token_sizes)
            _progress(progress, f"job {i + 1}/{total} (slots {slots}, prompt_len {p}", m)
            bound = sampling_params(model, 1, None, settings).max_tokens if m is None else m
            bound = int(np.max(np.asarray(bound)))
            request = Request([0] * p, {**settings, "max_tokens": 1})
            generate_many(
                model, [request], slots=slots, max_prompt_len=p, max_tokens_bound=bound,
                **job, **shared,
            )  # fmt: skip
            buckets.append((slots, p, bound))
    if progress:
        print(file=sys.stderr)
    cached = len(log.runs) - log.compiled
    return PrecompileReport(log.compiled, cached, time.perf_counter() - started, buckets)


def _progress(show: bool, what: str, max_tokens: int | None) -> None:
    """The progress line: `what` and the bucket's max_tokens, over the previous line."""
    if show:
        tokens = "" if max_tokens is None else f", max_tokens {max_tokens}"
        print(f"\rprecompile: {what}{tokens})", end="", file=sys.stderr, flush=True)


def _sizes(name: str, value: int | Sequence[int], lo: int) -> list[int]:
    """A size argument as a sorted list of ints >= `lo` (an int or a list of them)."""
    values = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not values:
        raise ValueError(f"{name} is empty: give at least one size")
    return sorted({check_count(name, v, lo) for v in values})


def precompile(
    model: Any,
    *,
    rows: int | Sequence[int] | None = None,
    prompt_len: int | Sequence[int] = 16,
    max_tokens: int | Sequence[int] | None = None,
    slots: int | None = None,
    progress: bool = False,
    **keywords: Any,
) -> PrecompileReport:
    """Compile the programs `generate` and `stream` run for batches of `rows` prompts of up
    to `prompt_len` tokens generating up to `max_tokens` each: every combination of the
    sizes given (each an int or a list), under the sampling settings and shared options in
    `keywords` (as `generate` takes them: `n=4`, `deterministic=True`, `logprobs=5`,
    `json_schema=...`, `speculative=...`; values do not matter, only which features they
    turn on and their table sizes). `max_tokens` defaults to the checkpoint's (or 16).

    A size picks its bucket: rows=5 compiles the 8-row programs, which serve 5 to 8 prompts
    (`rows` defaults to 1).
    Returns a `PrecompileReport`; `progress=True` prints a progress line to stderr. From
    then on, a call that needs a program none of the process's precompiled buckets holds
    still runs (it compiles its own) and warns once per program, naming the new dimension
    ("prefill compiled a new program (rows 8 -> 16), outside the buckets ...").

    `slots=S`: instead, the programs of a `generate_many` / `iter_generate_many` job with `S`
    slots whose longest prompt is `prompt_len` and whose largest `max_tokens` is
    `max_tokens` (its `max_prompt_len` and `max_tokens_bound`); `keywords` may also hold
    that job's own arguments (`prefill_batch`, `chunk_steps`, `kv_cache_tokens`,
    `page_size`, `prefix_cache`). Its admission programs are compiled by admitting one
    one-token request of each size (a prefill of one group and an empty decode chunk run).
    The job's rows are its slots: `rows` is refused with `slots`. The report counts
    programs as `ll.compile_stats` does: those compiled now, and those the job ran that
    this process had compiled already (`cached`).
    """
    with preparing():
        return _precompile(model, rows, prompt_len, max_tokens, slots, progress, keywords)


def _precompile(model, rows, prompt_len, max_tokens, slots, progress, keywords):
    prompt_sizes = _sizes("prompt_len", prompt_len, 1)
    token_sizes = [None] if max_tokens is None else _sizes("max_tokens", max_tokens, 1)
    if slots is not None:
        if rows is not None:
            raise ValueError(
                f"precompile: rows={rows!r} with slots={slots!r}: a generate_many job runs "
                "its slots as its rows; give slots (the job's programs) or rows (generate's "
                "buckets), not both"
            )
        slots = check_count("slots", slots, 1)
        return _precompile_job(model, slots, prompt_sizes, token_sizes, progress, keywords)
    options, settings = Options.split("precompile", keywords)
    job = plan(model, options, adapters=True)
    row_sizes = _sizes("rows", 1 if rows is None else rows, 1)
    combos = list(itertools.product(row_sizes, prompt_sizes, token_sizes))
    started, compiled, cached, buckets = time.perf_counter(), 0, 0, []
    for i, (r, p, m) in enumerate(combos):
        _progress(progress, f"bucket {i + 1}/{len(combos)} (rows {r}, prompt_len {p}", m)
        given = dict(settings) if m is None else {**settings, "max_tokens": m}
        params = sampling_params(model, r, None, given)
        ids = [[0] * p for _ in range(r)]
        names = [f"precompile(rows={r}, prompt_len={p})"] * r
        # The bucket itself, recorded so that later calls it covers reuse its programs.
        ids, params, shape = job.batch(None, params, ids=ids, names=names, fit=False)
        # Under `adapters=`, the rows' slots (the base's: values are data) and the table.
        adapted = options.adapters is not None
        tables, fsm = job.batch_tables(params, prompts=len(ids) // options.n if adapted else None)
        if on_pool(job, params.batch_size):
            run, fn, args, kwargs = forked_call(job, tables, ids, params, fsm, shape)
        else:
            run = job
            fn, args, kwargs = prefill_call(
                job.program, tables, ids, fsm=fsm, buffer_len=shape.buffer,
                prompt_len=shape.width,
            )  # fmt: skip
        state, new_prefill = fn.precompile(*args, **kwargs)
        steps = jax.ShapeDtypeStruct((), jnp.int32)
        _, new_decode = decode.precompile(run.program, tables, state, steps)
        for new in (new_prefill, new_decode):
            compiled += new
            cached += not new
        buckets.append((params.batch_size, args[2].prompt.shape[1], args[2].cache_len))
    if progress:
        print(file=sys.stderr)
    return PrecompileReport(compiled, cached, time.perf_counter() - started, buckets)
