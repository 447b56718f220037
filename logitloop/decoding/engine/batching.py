"""`generate_many` and `iter_generate_many`: a job's arguments checked, its defaults and
bounds settled, and its requests run by the slots' batcher (`batcher._Batcher`), or by the
paged one when the job gives `kv_cache_tokens` (`paged_batching`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from logitloop.decoding.engine import job_adapters, job_capture, job_guidance, paged_batching
from logitloop.decoding.engine.batcher import _Batcher
from logitloop.decoding.engine.host import GenerationResult, check_count
from logitloop.decoding.engine.job_requests import (
    Request,
    _bounds_from,
    _describe,
    _split_request,
)
from logitloop.decoding.engine.plan import Options, draft_inputs, plan
from logitloop.decoding.engine.prefix_cache import PrefixBatcher
from logitloop.decoding.sampling.params import SamplingParams, canonical_knobs, generation_defaults

__all__ = ["Request", "generate_many", "iter_generate_many"]


def iter_generate_many(
    model: Any,
    requests: Iterable[Any],
    params: Mapping[str, Any] | None = None,
    *,
    slots: int = 16,
    chunk_steps: int = 8,
    prefill_batch: int | None = None,
    max_prompt_len: int | None = None,
    max_tokens_bound: int | None = None,
    kv_cache_tokens: int | None = None,
    page_size: int = 16,
    prefix_cache: bool | None = None,
    stats: dict | None = None,
    **keywords: Any,
) -> Iterator[tuple[int, GenerationResult]]:
    """Like `generate_many`, but yields `(index, result)` as each request completes.

    Requests are read from `requests` lazily, so it may be a generator: enough to fill the
    free slots, plus up to `prefill_batch` rows ahead (tokenized and validated while the
    device runs a chunk). A bad request raises `ValueError` naming its index when it is
    read; results that completed before have been yielded by then.
    """
    return _job(
        "iter_generate_many", model, requests, params, slots=slots, chunk_steps=chunk_steps,
        prefill_batch=prefill_batch, max_prompt_len=max_prompt_len,
        max_tokens_bound=max_tokens_bound, kv_cache_tokens=kv_cache_tokens,
        page_size=page_size, prefix_cache=prefix_cache, stats=stats, keywords=keywords,
    )  # fmt: skip


def _job(
    caller: str,
    model: Any,
    requests: Iterable[Any],
    params: Mapping[str, Any] | None,
    *,
    slots: int,
    chunk_steps: int,
    prefill_batch: int | None,
    max_prompt_len: int | None,
    max_tokens_bound: int | None,
    kv_cache_tokens: int | None,
    page_size: int,
    prefix_cache: bool | None,
    stats: dict | None,
    keywords: Mapping[str, Any],
) -> Iterator[tuple[int, GenerationResult]]:
    """`iter_generate_many`'s job for the public function `caller` (named in errors): its
    arguments checked, its defaults and bounds settled, the batcher started."""
    options, settings = Options.split(caller, keywords)
    job = plan(model, options, adapters=True, guidance=True, inside=True, capture_samples=True)
    job_guidance.check_job(options)
    job = job_capture.scattering(job)
    if getattr(options.speculative, "adapters", None) is not None and options.adapters is None:
        draft_inputs(job.draft_weights, options, None)  # refuses, naming what runs
    job_adapters.check_job_adapter(options.adapter)
    info, layout = job.info, job.layout
    slots = check_count("slots", slots, 1)
    layout.check_rows("slots", slots)
    chunk_steps = check_count("chunk_steps", chunk_steps, 1)
    if prefill_batch is None:
        multiple = layout.row_multiple
        prefill_batch = -(-min(4, -(-slots // 8)) // multiple) * multiple
        if job_guidance.any_guided(requests, options):  # a guided row and its negative row
            prefill_batch = min(max(prefill_batch, 2), slots)
    group = check_count("prefill_batch", prefill_batch, 1, slots)
    layout.check_rows("prefill_batch", group)
    if not isinstance(params, (Mapping, type(None))):
        raise ValueError(
            f"params must be a dict of SamplingParams.create arguments, got {params!r}"
        )
    defaults = {
        **generation_defaults(model),
        **canonical_knobs(params or {}, "params: "),
        **canonical_knobs(settings),
    }
    if isinstance(requests, (str, bytes)):
        raise ValueError("requests must be an iterable of requests, not a string")
    if "max_tokens" in settings and max_tokens_bound is None and _all_set_max_tokens(requests):
        warnings.warn(
            "max_tokens= is the default max_tokens of requests that give none, and every "
            "request gives its own: to bound them (what max_tokens= did before), pass "
            "max_tokens_bound=",
            DeprecationWarning,
            stacklevel=3,  # the user's call of generate_many or iter_generate_many
        )
    adapters = job_adapters.for_job(options, slots)
    if adapters is not None and isinstance(requests, Sequence):  # names known, slots free
        adapters.check_requests(
            [job_adapters.request_adapter(item) for item in requests],
            lambda i: _describe(i, getattr(requests[i], "id", None)),
        )
    if isinstance(requests, Sequence) and (max_prompt_len is None or max_tokens_bound is None):
        longest, most = _bounds_from(info, requests, defaults)
        longest = max(longest, job_guidance.longest_negative(info, requests, options))
        max_prompt_len = longest if max_prompt_len is None else max_prompt_len
        max_tokens_bound = most if max_tokens_bound is None else max_tokens_bound
    if max_tokens_bound is None:
        max_tokens_bound = info.max_length - 1
    if max_prompt_len is None:
        max_prompt_len = info.max_length - 1
    max_prompt_len = check_count("max_prompt_len", max_prompt_len, 1, info.max_length - 1)
    max_tokens_bound = check_count("max_tokens_bound", max_tokens_bound, 1, info.max_length - 1)
    bounds = dict(
        slots=slots,
        max_prompt_len=max_prompt_len,
        max_tokens=max_tokens_bound,
        chunk_steps=chunk_steps,
        prefill_batch=group,
        defaults=defaults,
    )
    if prefix_cache not in (None, True, False):
        raise ValueError(f"prefix_cache must be True, False or None, got {prefix_cache!r}")
    prefix_cache = job_capture.prefix_cache(options, prefix_cache)  # False for prompt capture
    refusal = paged_batching.prefix_refusal(job)
    if prefix_cache is None:
        prefix_cache = refusal is None
    elif prefix_cache and refusal is not None:
        raise ValueError(f"prefix_cache=True: {refusal}")
    if kv_cache_tokens is None:
        if not prefix_cache:
            return _Batcher(job, **bounds).run(requests)
        kv_cache_tokens = paged_batching.slots_memory(
            slots, max_prompt_len, max_tokens_bound, page_size
        )
    factory = paged_batching.PagedBatcher  # every row owns its pages
    if refusal is None and job_capture.shares_prompts(options):
        # a request's n rows share its prompt's pages; the cache keeps them
        factory = functools.partial(PrefixBatcher, keep=prefix_cache)
    batcher = paged_batching.batcher(
        job, requests, kv_cache_tokens, page_size, {} if stats is None else stats,
        factory=factory, **bounds,
    )  # fmt: skip
    return batcher.run(requests)


def _all_set_max_tokens(requests: Any) -> bool:
    """Whether `requests` is a non-empty sequence whose every request sets its max_tokens."""
    if not isinstance(requests, Sequence) or not requests:
        return False
    for item in requests:
        knobs = _split_request(item).params
        if not isinstance(knobs, SamplingParams) and not (
            isinstance(knobs, Mapping) and ({"max_tokens", "max_new_tokens"} & set(knobs))
        ):
            return False
    return True


def generate_many(
    model: Any,
    requests: Iterable[Any],
    params: Mapping[str, Any] | None = None,
    *,
    slots: int = 16,
    chunk_steps: int = 8,
    prefill_batch: int | None = None,
    max_prompt_len: int | None = None,
    max_tokens_bound: int | None = None,
    kv_cache_tokens: int | None = None,
    page_size: int = 16,
    prefix_cache: bool | None = None,
    stats: dict | None = None,
    **keywords: Any,
) -> list[GenerationResult]:
    """Generate completions for many prompts with continuous batching; results in input order.

    requests: any iterable (a generator too) of `Request(prompt, params, id)`,
      `(prompt, params)` pairs or bare prompts; a prompt is a string (with a tokenizer) or a
      list of token ids; a request's params are `SamplingParams.create` keyword arguments
      (or a `SamplingParams` of batch size 1) and replace the job-wide `params` defaults.
    slots: rows decoded together. chunk_steps: decode steps between admissions.
    prefill_batch: prompts prefilled per admission call (a fixed shape; default
      `ceil(slots / 8)`, at most 4); a call with fewer waiting prompts pads with dummy rows.
    params and sampling keywords (`max_tokens=64`, `temperature=0.7`, `max_new_tokens`
      for `max_tokens`): the job's defaults, for every setting a request gives none of:
      a dict of `SamplingParams.create` arguments, and keywords over it, over the
      checkpoint's `generation_config.json` (as in `generate`). Seeds are explicit (JAX's
      convention): requests without a `seed` all use the job's (default 0).
    max_prompt_len, max_tokens_bound: bounds that fix the prompt bucket and the buffer (and
      so the cache) for the whole job. Default: from the requests when they are a sequence,
      else the model's context (correct, but a larger cache than needed: pass bounds for
      a generator). A request over a bound raises ValueError. (`max_tokens_bound` was
      called `max_tokens` before `max_tokens=` became the requests' default.)
    The other keywords are the shared options of `generate`
    (`logitloop.decoding.engine.plan.Options`):
    n, ignore_eos, mesh: as in `generate`. On a mesh, `slots` and `prefill_batch` must be
      multiples of the data-axis size (the default `prefill_batch` is rounded up to one).
    processors: the job's processors (leaves with a row axis of 1), for requests that
      bring none of their own (`Request.processors`).
    deterministic: as in `generate`: a request's tokens and logprobs do not depend on the
      slots, the other requests or `prefill_batch`.
    speculative: as in `generate`; a chunk is then `chunk_steps` propose-verify cycles (or
      plain steps), and each result's `speculation` counts its rows' drafts.
    kv_cache_tokens, page_size: the slots share one paged pool of `kv_cache_tokens` tokens
      of keys and values in pages of `page_size` (a power of two), whatever `slots` is
      (`logitloop.decoding.engine.paged_batching`: admission by free pages, pages freed as
      rows finish, preemption); default: a pool of the memory a contiguous cache per slot
      holds (`slots * (max_prompt_len + max_tokens_bound)`, in the buckets), or with
      `prefix_cache=False` (or a `FunctionModel` with its own `init_cache`, a model whose
      layers' windows differ) that
      contiguous cache itself. A model whose layers' windows differ (Gemma 2 and 3) gets a
      page table per window: `kv_cache_tokens` is then the global layers' tokens, and each
      window's layers get the pages their windows need (docs/paged_cache.md). On a mesh:
      one pool per data shard (`kv_cache_tokens` a multiple of the data-axis size times
      `page_size`), each serving its shard's slots.
    prefix_cache: on a pool (default True): rows share the cached full pages of the
      prompt prefix they have in common with earlier rows (and a request's `n` rows its
      prompt's), and prefill only the rest; cached pages stay until the pool needs them,
      least recently used first (`logitloop.decoding.engine.prefix_cache`). False: every
      prompt prefilled whole (with `kv_cache_tokens`, only a request's own rows share).
    stats: a dict the paged job fills with its counts (preemptions, rows in flight, pages
      held per layer group; prompt, prefilled and cached tokens, evicted pages).
    adapters, adapter: LoRA adapters (an `ll.Adapters`, `ll.load_adapter`) and the adapter
      (a name, or None: the base) of every request that names none of its own
      (`Request(prompt, adapter=name)`; `Request(prompt, adapter=(name, source))` loads
      `source` into the table while the job runs, compiling nothing, into a free slot or
      an idle brought adapter's, `logitloop.decoding.engine.job_adapters`). A
      request's `n` rows share its adapter; the prefix cache keys pages by adapter
      (`logitloop.decoding.engine.job_adapters`).
    steer: steering vectors (an `ll.Steer` or a list of them) for every request that
      gives none of its own (`Request(prompt, steer=...)`; `[]`: none); new vectors
      compile nothing, and the prefix cache keys pages by the vectors that reach the
      prompt (`logitloop.decoding.engine.job_steering`, docs/inside.md).
    guidance_scale, negative_prompt: classifier-free guidance (one value each) for every
      request that gives none of its own (`Request(prompt, guidance_scale=...,
      negative_prompt=...)`; scale 1: unguided), as `generate`'s for its prompt: each
      guided row takes a second slot for its negative row, admitted, preempted and freed
      with it (`logitloop.decoding.engine.job_guidance`, docs/guidance.md).
    capture: an `ll.Capture`, the job's: each result's `captured`, one `[T, C, E]` float32
      array per row aligned with its `token_ids` as `generate(..., capture=)`'s
      (`logitloop.decoding.engine.job_capture`; `n > 1` too, not `speculative=` or
      `mesh=`). `Capture(prompt=True)` prefills every prompt whole: `prefix_cache`
      defaults to False and True is refused (a cached page's tokens get no states).

    Returns one `GenerationResult` per request, each holding that prompt's `n` rows, equal to
    `generate(model, [prompt], SamplingParams.create(1, **knobs), n=n)` but for `text`:
    the request's text (a str) when `n = 1`, a list of `n` strings when `n > 1`
    (`GenerationResult.texts` is always the list).
    """
    out: dict[int, GenerationResult] = {}
    for index, result in _job(
        "generate_many", model, requests, params, slots=slots, chunk_steps=chunk_steps,
        prefill_batch=prefill_batch, max_prompt_len=max_prompt_len,
        max_tokens_bound=max_tokens_bound, kv_cache_tokens=kv_cache_tokens,
        page_size=page_size, prefix_cache=prefix_cache, stats=stats, keywords=keywords,
    ):  # fmt: skip
        out[index] = result
    return [out[i] for i in range(len(out))]
