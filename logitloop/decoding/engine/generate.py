"""`generate` and `stream`: one batch of prompts through the device loop.

Both start from one plan (`logitloop.decoding.engine.plan`), go through the host side
(`logitloop.decoding.engine.host`: prompts, padding, the initial state, results) and run the
device loop (`logitloop.decoding.loop.decode_loop`); `stream` runs the same compiled loop in
chunks and detokenizes as it goes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import guidance as guided
from logitloop.decoding.engine import memory_check
from logitloop.decoding.engine.host import (  # noqa: F401 - re-exported: the public host-side names
    FINISH_REASON,
    MIN_BUFFER_BUCKET,
    MIN_PROMPT_BUCKET,
    GenerationResult,
    StopReason,
    bucket,
    buffer_for,
    check_count,
    collect,
    fill_rows,
    initial_state,
    pad_prompts,
    prompt_batch,
    row_stops,
    row_text,
    stop_reason,
    tokenize_prompts,
)
from logitloop.decoding.engine.inside import check_capture_size, row_states
from logitloop.decoding.engine.paged_batching import sharing_refusal
from logitloop.decoding.engine.plan import BatchShape, Options, Plan, plan, sampling_params
from logitloop.decoding.engine.score import prompt_scores
from logitloop.decoding.loop import forked, stop_strings
from logitloop.decoding.loop import speculative as speculation
from logitloop.decoding.loop.decode_loop import RUNNING, DecodeState, Tables, decode
from logitloop.decoding.loop.forked import prefill_forked
from logitloop.decoding.sampling.checks import MAX_TOP_LOGPROBS
from logitloop.decoding.sampling.params import SamplingParams

PAGE_SIZE = 16  # tokens per page of the pool that `n > 1` rows share


def generate(
    model: Any,
    prompts: Sequence[Any],
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    prompt_logprobs: int | None = None,
    return_routing: bool = False,
    **keywords: Any,
) -> GenerationResult:
    """Generate completions for a batch of prompts, each row under its own settings.

        ll.generate(model, ["The for statement"])                    # the checkpoint's defaults
        ll.generate(model, prompts, temperature=0.7, max_new_tokens=20)
        ll.generate(model, prompts, {"temperature": [0.0, 0.8], "seed": [1, 2]})

    model: a logitloop NNX model or a `FunctionModel`; prompts: token-id lists or strings
    (with a tokenizer). params: a `SamplingParams` with one row per prompt, used as it is;
    or a dict of `SamplingParams.create` arguments, and/or those arguments as keywords
    (`max_new_tokens` is `max_tokens`' alias): each a scalar for every prompt or one value
    per prompt, over the checkpoint's `generation_config.json` (`SamplingParams.from_model`),
    over `create`'s defaults (16 tokens, temperature 1, seed 0). Seeds are explicit, as in
    JAX: the same call gives the same tokens; pass `seed=` to draw differently.
    The other keywords are the shared options of `logitloop.decoding.engine.plan.Options`,
    below (an unknown keyword raises TypeError listing both sets). `n` samples per prompt
    (rows repeated prompt-major; sample i > 0 gets a seed derived from the row's); with
    `n > 1` each prompt is prefilled once and its rows share its KV pages
    (`logitloop.decoding.loop.forked`).
    The model's EOS ids join every row's stop ids unless `ignore_eos`.

    Returns one `GenerationResult` for the batch: every field, `text` included, a list
    with one entry per row (`B * n` rows).

    A row ends with finish_reason "stop" (a stop token id, stop sequence or stop string
    matched, `stop_reason` says which; or its constraint's document is complete and can only
    end, `stop_reason` None), "length" (max_tokens), "repetition" (its `repetition_guard`
    saw its last tokens repeat; every token and the text kept) or "error" (its logits held
    NaN/inf or every token was masked). `token_ids` holds every generated token including a
    matched stop token; `text` (when the model has a tokenizer) is the UTF-8 text of those
    tokens without a matched stop token id; a row that a stop string ended is cut before the
    occurrence that ended it (kept with `include_stop_str_in_output`). An occurrence ending
    within the first `min_tokens - 1` tokens does not count, and is kept.

    Prefill and decode are two jit-compiled calls; prompt length and buffer length are
    bucketed to powers of two, so a new prompt length or max_tokens rarely compiles.

    `mesh`: a `jax.sharding.Mesh` with axes "data" (rows) and "model" (weights, KV heads,
    vocabulary) to run sharded, on one host or several (`logitloop.decoding.loop.sharding`);
    the tokens are those of the single-device run.

    `processors`: user transforms with per-row settings and state, composed into every
    row's sampling step (`logitloop.decoding.sampling.processors`); their leaves have one row per
    prompt (repeated for `n > 1`).

    `deterministic=True` (logitloop's models): a row's logits, and so its tokens,
    logprobs and finish reason, are bit for bit those of the row alone, whatever the
    batch, the prompt bucket and buffer, and on a data-parallel mesh;
    `deterministic="model-parallel"` also on a model axis of 1, 2, 4 or 8 devices
    (`logitloop.models.fixed_order`; docs/deterministic.md).

    `speculative`: `ll.PromptLookup(...)` or `ll.DraftModel(...)` to decode speculatively
    (`logitloop.decoding.loop.speculative`): strict acceptance gives the same tokens, rejection
    acceptance the same distribution; `result.speculation` counts drafts per row.

    `prompt_logprobs=n` (0..20): `result.prompt_logprobs[i]`, the `ll.score` of row i's
    prompt tokens after its first (raw log-probabilities, argmax flags and n raw
    alternatives per position: exactly `ll.score(model, [p[:1]], [p[1:]], top_logprobs=n)`).

    `guidance_scale=`, `negative_prompt=`: classifier-free guidance per prompt, as
    transformers' `generate(guidance_scale=..., negative_prompt_ids=...)`: each guided row
    is decoded beside a row of its negative context (default its prompt's last token) in
    the same loop, and draws from `uncond + scale * (cond - uncond)` on log-softmaxed
    logits, before every other transform (`logitloop.decoding.engine.guidance`,
    docs/guidance.md). Beside `steer=` the negative row runs under its row's vectors;
    beside `capture=` only the real rows' states come back.

    `return_routing=True` (a mixture of experts; not with `speculative` or `mesh`):
    `result.routing[i]`, the experts each routed layer sent each of row i's prompt and
    generated tokens to (`GenerationResult.routing`), for `ll.token_logprobs(...,
    routing=)` to replay (docs/rl.md, "Routing replay"). Without it the loop carries
    no routing state.

    `steer=ll.Steer(vector, layer, scale)` (or one entry per prompt): steering vectors
    added to the residual stream; `capture=ll.Capture(layers=...)`: `result.captured[i]`,
    row i's residual stream at those layers (docs/inside.md).
    """
    if prompt_logprobs is not None:
        check_count("prompt_logprobs", prompt_logprobs, 0, MAX_TOP_LOGPROBS)
    options, settings = Options.split("generate", keywords)
    job = plan(model, options, adapters=True, guidance=True, inside=True)
    if return_routing:
        job = _recording(job)
    run = _start(model, job, prompts, params, settings)
    state = decode(run.plan.program, run.tables, run.state, np.int32(2**30))  # compiles nothing
    result = collect(run.plan.layout.host_view(state).outputs(), run.ids, run.params, run.info)
    if return_routing:
        result.routing = _row_routing(state.routing, run.ids, result.num_tokens)
    if options.capture is not None:
        result.captured = row_states(
            state.capture, run.ids, result.num_tokens, options.capture.prompt
        )
    if run.plan.program.speculative is not None:
        result.speculation = speculation.stats(state.speculation, len(run.ids))
    if prompt_logprobs is not None:
        o = run.plan.options
        scores = prompt_scores(model, run.ids[:: o.n], prompt_logprobs, o.mesh, o.deterministic)
        result.prompt_logprobs = [s for s in scores for _ in range(o.n)]
    return result


def _recording(job: Plan) -> Plan:
    """The plan whose loop records each token's experts (`return_routing=True`)."""
    if job.info.runner.routing_shape(job.info.weights) is None:
        raise ValueError(
            "return_routing=True needs a mixture-of-experts model (Mixtral, Qwen3-MoE): "
            "this model has no routed layers"
        )
    if job.program.speculative is not None or job.options.mesh is not None:
        raise ValueError("return_routing=True does not combine with speculative or mesh")
    if job.options.capture is not None:
        raise NotImplementedError("return_routing=True does not combine with capture= yet")
    return dataclasses.replace(job, program=dataclasses.replace(job.program, routing=True))


def _row_routing(routing: Any, ids: list[list[int]], num_tokens: list[int]) -> list[np.ndarray]:
    """Each row's [prompt + generated, L, k] experts from the loop's (prompt [B, P, L, k]
    left-padded, generated [B, N, L, k])."""
    prompt, generated = (np.asarray(x) for x in jax.device_get(routing))
    width = prompt.shape[1]
    return [
        np.concatenate([prompt[r, width - len(row) :], generated[r, : num_tokens[r]]])
        for r, row in enumerate(ids)
    ]


@dataclasses.dataclass
class _Run:
    """What `generate` and `stream` start from: the plan, the checked rows, the tables the
    loop reads and the state after prefill."""

    plan: Plan
    ids: list[list[int]]
    params: SamplingParams  # host-side, row by row
    tables: Tables
    state: DecodeState

    @property
    def info(self):
        return self.plan.info


def _start(
    model: Any, plan: Plan, prompts: Sequence[Any], params: Any, settings: Mapping[str, Any]
) -> _Run:
    ids = tokenize_prompts(prompts, plan.info)
    params = sampling_params(model, len(ids), params, settings)
    o, prompt_count = plan.options, len(ids)
    guide = guided.guided_prompts(plan.info, ids, o.guidance_scale, o.negative_prompt, params)
    if guide is not None:  # the negative prompts join the batch after the real ones
        ids, params = guide.with_negatives(ids, params)
        if o.steer is not None:  # each negative row steered as its row; captured: all rows,
            o = dataclasses.replace(o, steer=guide.with_negatives_steer(o.steer))  # the real
            plan = dataclasses.replace(plan, options=o)  # rows' returned (`_Run.ids`)
    ids, params, shape = plan.batch(None, params, ids=ids)
    tables, fsm = plan.batch_tables(params, prompts=prompt_count, ids=ids)
    if guide is not None:
        guidance = guide.tables(o.n, params.batch_size)
        rows = guided.negative_rows_adapters(tables.rows, guidance)
        tables = tables.replace(guidance=guidance, rows=rows)
    if o.capture is not None:
        layers = len(o.capture.model_layers(plan.num_layers))
        check_capture_size(
            o.capture, layers, params.batch_size, shape.width, shape.buffer,
            plan.info.residual_width,
        )  # fmt: skip
    if on_pool(plan, params.batch_size):
        plan, state = _forked_state(plan, tables, ids, params, fsm, shape)
    else:
        state = initial_state(
            plan.program, tables, ids, fsm=fsm, buffer_len=shape.buffer, prompt_len=shape.width
        )
    return _Run(plan, ids[: prompt_count * o.n], params, tables, state)


def on_pool(plan: Plan, rows: int) -> bool:
    """Whether `generate` and `stream` run on a paged pool: with `n > 1`, where rows may
    share pages (`sharing_refusal`). With `n = 1` they keep the contiguous cache: on the
    pool a float32 llama-40m's whole call took 1.12-1.14x the time (the loop's page
    bookkeeping), bfloat16 rows' greedy tokens changed, and sliding-window layers would
    hold pages instead of rings (`scripts/bench_layout.py`, docs/paged_cache.md)."""
    # On a mesh each data shard's rows must be whole prompts' n rows (the prompts split
    # over the data axis): they share pages in their shard's pool.
    prompts_split = rows // plan.options.n % plan.layout.row_multiple == 0
    return plan.options.n > 1 and sharing_refusal(plan) is None and prompts_split


def _forked_state(
    plan: Plan,
    tables: Tables,
    ids: list[list[int]],
    params: SamplingParams,
    fsm: Any,
    shape: BatchShape | None = None,
) -> tuple[Plan, DecodeState]:
    """`n > 1`: each prompt prefilled once into a paged pool, its `n` rows sharing its
    pages (`logitloop.decoding.loop.forked`, `forked.pool_shape`: each prompt's pages once,
    each row's own); the plan with the pool's shape and the state after prefill."""
    plan, fn, args, kwargs = forked_call(plan, tables, ids, params, fsm, shape)
    return plan, memory_check.checked_call("prompts", args[2].prompt.size, fn, *args, **kwargs)


def forked_call(
    plan: Plan,
    tables: Tables,
    ids: list[list[int]],
    params: SamplingParams,
    fsm: Any,
    shape: BatchShape | None = None,
) -> tuple[Plan, Any, tuple, dict[str, Any]]:
    """The prefill `_forked_state` runs: the plan with the pool's shape, and the jitted
    function with its arguments and keywords (what `precompile` compiles ahead of time).
    `shape`: the batch's buffer and prompt width (`Plan.batch`; default the rows' own)."""
    n = plan.options.n
    ids = fill_rows(ids, params.batch_size)  # dummy prompts' rows included
    buffer_len = buffer_for(params) if shape is None else shape.buffer
    batch = prompt_batch(ids[::n], buffer_len, None if shape is None else shape.width)
    shards = plan.layout.row_multiple  # one pool per data shard
    shape = forked.pool_shape(len(ids) // n, n, batch.cache_len, PAGE_SIZE, buffer_len, shards)
    plan = dataclasses.replace(plan, program=dataclasses.replace(plan.program, pool=shape))
    keywords = dict(n=n, buffer_len=buffer_len, num_top=params.top_logprobs_width)
    return plan, prefill_forked, (plan.program, tables, batch, fsm), keywords


@dataclasses.dataclass
class StreamEvent:
    """New output of one row since its previous event."""

    row: int
    text: str  # text delta (empty without a tokenizer)
    token_ids: list[int]  # tokens generated since the previous event
    finish_reason: str | None = None  # set on the row's last event
    stop_reason: StopReason = None  # set on the row's last event, as in `GenerationResult`
    # with `capture=`: the states of `token_ids` ([len(token_ids), C, E] float32; the row's
    # first event has its prompt's before them with `Capture(prompt=True)`), so a row's
    # events' arrays, concatenated, are `generate(...).captured` for the row
    captured: np.ndarray | None = None


def stream(
    model: Any,
    prompts: Sequence[Any],
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    chunk_steps: int = 8,
    **keywords: Any,
) -> Iterator[StreamEvent]:
    """Generate like `generate`, yielding per-row deltas every `chunk_steps` decode steps.

    The loop runs on device in chunks (the same compiled program as `generate`), and the
    host detokenises incrementally. A delta never holds an incomplete UTF-8 sequence, nor
    the tail of the text that could still begin one of the row's stop strings; each row
    ends with one event carrying its finish_reason. Concatenating a row's deltas gives
    exactly `generate(...).text` for that row. `params` and `keywords` (sampling settings
    and options, `guidance_scale=` and `negative_prompt=` included): as in `generate`.
    With `speculative` a chunk is `chunk_steps` propose-verify cycles. With `capture=`,
    each event carries its tokens' states (`StreamEvent.captured`).
    """
    check_count("chunk_steps", chunk_steps, 1)
    options, settings = Options.split("stream", keywords)
    job = plan(model, options, adapters=True, guidance=True, inside=True)
    run = _start(model, job, prompts, params, settings)
    states = _StreamStates(options.capture, run)
    info, ids, params, layout, state = run.info, run.ids, run.params, run.plan.layout, run.state
    batch = len(ids)
    tok = info.tokenizer
    seen = [0] * batch
    emitted = [""] * batch
    open_rows = set(range(batch))
    detok = [stop_strings.Detokenizer(tok) if tok is not None else None for _ in range(batch)]
    seqs = np.asarray(params.stop_sequences)
    while True:
        tokens, num, finish, matched, step = jax.device_get(
            layout.host_view(
                (state.tokens, state.num_tokens, state.finish, state.matched, state.step)
            )
        )
        states.fetch(state)
        for r in sorted(open_rows):
            k, code = int(num[r]), int(finish[r])
            new = tokens[r, seen[r] : k].tolist()
            captured = states.of(r, seen[r], k)
            seen[r] = k
            stops_r, include, min_r = row_stops(params, r)
            if code != RUNNING:
                reason = FINISH_REASON.get(code, "length")
                stop = stop_reason(code, int(matched[r]), seqs[r])
                text = ""
                if tok is not None:
                    final, hit = row_text(
                        tok, tokens[r, :k].tolist(), code, stops_r, include, min_r
                    )
                    if hit is not None:
                        reason, stop = "stop", hit
                    text = final[len(emitted[r]) :]
                open_rows.discard(r)
                yield StreamEvent(r, text, new, reason, stop, captured)
                continue
            delta = ""
            if tok is not None:
                detok[r].feed(new)
                visible = detok[r].text
                visible = visible[: len(visible) - stop_strings.held_back(visible, stops_r)]
                delta = visible[len(emitted[r]) :]
                emitted[r] = max(visible, emitted[r], key=len)
            if new or delta:
                yield StreamEvent(r, delta, new, captured=captured)
        if not open_rows:
            return
        state = decode(run.plan.program, run.tables, state, np.int32(int(step) + chunk_steps))


class _StreamStates:
    """`stream`'s captured states (`capture=`): the generated ones read back each chunk,
    and each row's prompt's (with `Capture(prompt=True)`, read before the loop runs: the
    loop donates its state) given with its first event that has tokens."""

    def __init__(self, capture: Any, run: _Run):
        self.capture, self.generated, self.prompt = capture, None, {}
        if capture is not None and capture.prompt:
            rows = row_states(run.state.capture, run.ids, [0] * len(run.ids), True)
            self.prompt = dict(enumerate(rows))

    def fetch(self, state: DecodeState) -> None:
        if self.capture is not None:
            self.generated = np.asarray(jax.device_get(state.capture[1]))

    def of(self, row: int, start: int, stop: int) -> np.ndarray | None:
        """Row `row`'s states of its generated tokens `start:stop` (its prompt's first)."""
        if self.capture is None:
            return None
        states = self.generated[row, start:stop]
        if row in self.prompt and stop > start:
            states = np.concatenate([self.prompt.pop(row), states])
        return states
