"""`generate`: one-pass prefill, then one `lax.while_loop` that samples until every row stops.

Index bookkeeping, for one row with prompt [a, b, c] in a batch whose prompts are bucketed to
P = 4 columns and whose generation buffer holds N tokens:

    prefill tokens     [pad, a, b, c]     positions [-1, 0, 1, 2]
    cache slots        0:a 1:b 2:c        (the pad is never written)
    logits of column 3 -> token t0, generated index 0, random stream (seed, 0)
    step 1 feeds t0 at position 3 -> t1 (index 1), step 2 feeds t1 at position 4 -> t2, ...

so the token generated at index i is fed back at position `prompt_len + i`, and the cache
needs `P + N` slots. A row stops after the token that matches one of its stop conditions;
from then on the loop leaves its slots, cache and counters untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding import sharding, stop_strings
from logitloop.decoding.history import History
from logitloop.decoding.model import ModelInfo, ModelRunner, model_info
from logitloop.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from logitloop.decoding.sampler import STATUS_OK, SampleOutput
from logitloop.decoding.stop_strings import StopStrings

# finish codes, per row
RUNNING = 0
FINISH_STOP_TOKEN = 1
FINISH_STOP_SEQUENCE = 2
FINISH_LENGTH = 3
FINISH_ERROR = 4
FINISH_STOP_STRING = 5

MIN_PROMPT_BUCKET = 16
MIN_BUFFER_BUCKET = 16


def bucket(n: int, minimum: int) -> int:
    """Round up to a power of two (at least `minimum`) so that new lengths rarely compile."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries from one step to the next.

    B rows, N = generation buffer length, P + N cache slots, L = longest stop sequence.
    """

    step: jax.Array  # [] i32, loop iterations run (tokens drawn after the first)
    done: jax.Array  # [B] bool, the row has stopped; it never changes again
    finish: jax.Array  # [B] i32, RUNNING or a FINISH_* code
    matched: jax.Array  # [B] i32, stop token id or stop-sequence index that matched, else -1
    tokens: jax.Array  # [B, N] i32, generated tokens, -1 past num_tokens
    num_tokens: jax.Array  # [B] i32, tokens generated so far
    logprobs: jax.Array  # [B, N] f32, log-prob under the final distribution
    raw_logprobs: jax.Array  # [B, N] f32, log-softmax of the model's logits
    top_ids: jax.Array  # [B, N, K] i32, K = MAX_TOP_LOGPROBS when asked, else 0
    top_values: jax.Array  # [B, N, K] f32
    prompt_len: jax.Array  # [B] i32
    cache: Any  # the model's KV cache, P + N slots per row
    history: History  # prompt + generated tokens, for the penalties
    window: jax.Array  # [B, L] i32, the last L generated tokens (stop sequences), -1 before
    text_window: jax.Array  # [B, W] i32, the last W bytes of generated text (stop strings)


@dataclasses.dataclass
class GenerationResult:
    """Host-side results, one entry per row (prompt-major when n > 1)."""

    token_ids: list[list[int]]
    finish_reason: list[str]  # "stop", "length" or "error"
    stop_reason: list[Any]  # the stop token id, stop sequence (list of ids) or stop string
    num_tokens: list[int]
    prompt_token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None  # per token, under the final distribution
    raw_logprobs: list[list[float]] | None = None
    top_logprobs: list[list[dict[int, float]]] | None = None
    text: list[str] | None = None
    error: list[str | None] | None = None


def _record(
    state: DecodeState, out: SampleOutput, params: SamplingParams, stops: StopStrings | None
) -> DecodeState:
    """Append each running row's new token and check its stop conditions."""
    batch, buf = state.tokens.shape
    active = ~state.done
    ok = out.status == STATUS_OK
    write = active & ok
    rows = jnp.arange(batch)
    col = jnp.where(write, state.num_tokens, buf)  # out of range -> dropped
    tok = out.tokens

    def put(arr, val):
        return arr.at[rows, col].set(val, mode="drop")

    num_tokens = state.num_tokens + write.astype(jnp.int32)
    window = jnp.where(
        write[:, None], jnp.concatenate([state.window[:, 1:], tok[:, None]], axis=1), state.window
    )

    # Stop token ids (EOS included by the caller).
    hit_token = jnp.any(params.stop_token_ids == tok[:, None], axis=1)
    # Multi-token stop sequences, right-aligned against the window of generated tokens.
    seqs = params.stop_sequences  # [B, Q, L]
    seq_hit = jnp.all((seqs < 0) | (seqs == window[:, None, :]), axis=2) & jnp.any(
        seqs >= 0, axis=2
    )
    seq_hit = seq_hit & (num_tokens >= params.min_tokens)[:, None]
    hit_seq = jnp.any(seq_hit, axis=1)
    hit_len = num_tokens >= params.max_tokens
    text_window = state.text_window
    if stops is None:
        hit_str = jnp.zeros_like(hit_seq)
        which_str = jnp.zeros_like(state.matched)
    else:
        text_window, hit_str, which_str = stop_strings.advance(text_window, stops, tok, write)
        hit_str = hit_str & (num_tokens >= params.min_tokens)

    finish = jnp.where(
        ~ok,
        FINISH_ERROR,
        jnp.where(
            hit_token,
            FINISH_STOP_TOKEN,
            jnp.where(
                hit_seq,
                FINISH_STOP_SEQUENCE,
                jnp.where(hit_str, FINISH_STOP_STRING, jnp.where(hit_len, FINISH_LENGTH, RUNNING)),
            ),
        ),
    )
    finish = jnp.where(active, finish, state.finish)
    matched = jnp.where(
        hit_token,
        tok,
        jnp.where(hit_seq, jnp.argmax(seq_hit, axis=1), jnp.where(hit_str, which_str, -1)),
    ).astype(jnp.int32)
    matched = jnp.where(active & ok, matched, state.matched)

    top_ids, top_values = state.top_ids, state.top_values
    if top_ids.shape[2]:
        top_ids = put(top_ids, out.top_logprobs.ids)
        top_values = put(top_values, out.top_logprobs.values)
    return state.replace(
        done=state.done | (finish != RUNNING),
        finish=finish.astype(jnp.int32),
        matched=matched,
        tokens=put(state.tokens, tok),
        num_tokens=num_tokens,
        logprobs=put(state.logprobs, out.logprobs),
        raw_logprobs=put(state.raw_logprobs, out.raw_logprobs),
        top_ids=top_ids,
        top_values=top_values,
        history=state.history.append(tok, where=write),
        window=window,
        text_window=text_window,
    )


@functools.partial(jax.jit, static_argnames=("runner", "buffer_len", "num_top", "mesh"))
def prefill(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    prompt_len: jax.Array,  # [B] i32
    history: History,  # [B, P + N]
    params: SamplingParams,
    stops: StopStrings | None,
    *,
    buffer_len: int,
    num_top: int,
    mesh: jax.sharding.Mesh | None = None,
) -> DecodeState:
    """Run the whole prompt in one forward pass and draw each row's first token."""
    batch, plen = prompt.shape
    prompt, positions, prompt_len, history, params = sharding.constrain_rows(
        (prompt, positions, prompt_len, history, params), mesh, batch
    )
    cache = runner.init_cache(weights, batch, plen + buffer_len)
    cache = sharding.constrain_cache(cache, batch, mesh)
    logits, cache = runner.forward(weights, prompt, positions, cache)
    window_len = params.stop_sequences.shape[2]
    state = DecodeState(
        step=jnp.zeros((), jnp.int32),
        done=jnp.zeros((batch,), bool),
        finish=jnp.zeros((batch,), jnp.int32),
        matched=jnp.full((batch,), -1, jnp.int32),
        tokens=jnp.full((batch, buffer_len), -1, jnp.int32),
        num_tokens=jnp.zeros((batch,), jnp.int32),
        logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
        raw_logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
        top_ids=jnp.full((batch, buffer_len, num_top), -1, jnp.int32),
        top_values=jnp.full((batch, buffer_len, num_top), -jnp.inf, jnp.float32),
        prompt_len=prompt_len,
        cache=cache,
        history=history,
        window=jnp.full((batch, window_len), -1, jnp.int32),
        text_window=(
            jnp.zeros((batch, 0), jnp.int32)
            if stops is None
            else stop_strings.empty_window(batch, stops)
        ),
    )
    out = sharding.sample(logits, params, state.num_tokens, history, mesh)
    return sharding.constrain_state(_record(state, out, params, stops), mesh)


@functools.partial(jax.jit, static_argnames=("runner", "mesh"), donate_argnames=("state",))
def decode(
    runner: ModelRunner,
    weights: Any,
    state: DecodeState,
    params: SamplingParams,
    stops: StopStrings | None,
    max_steps: jax.Array,  # [] i32: stop after this many loop iterations in total
    mesh: jax.sharding.Mesh | None = None,
) -> DecodeState:
    """Feed each row's last token and sample the next, until every row is done.

    Also stops once `state.step` reaches `max_steps` or the buffer is full, so that
    `stream` can run the same compiled loop in chunks.
    """
    buf = state.tokens.shape[1]

    def cond(s: DecodeState):
        return (s.step < max_steps) & jnp.any(~s.done) & (s.step < buf - 1)

    def body(s: DecodeState):
        batch = s.tokens.shape[0]
        last = jnp.take_along_axis(s.tokens, jnp.maximum(s.num_tokens - 1, 0)[:, None], axis=1)
        # Finished rows feed a padding position, so their cache is never written again.
        pos = jnp.where(s.done, -1, s.prompt_len + s.num_tokens - 1)[:, None]
        logits, cache = runner.forward(weights, jnp.maximum(last, 0), pos, s.cache)
        out = sharding.sample(logits, params, s.num_tokens, s.history, mesh)
        s = _record(s.replace(cache=cache), out, params, stops)
        del batch
        return sharding.constrain_state(s.replace(step=s.step + 1), mesh)

    return jax.lax.while_loop(cond, body, state)


# ----------------------------------------------------------------------------- host side


def _tokenize(prompts: Sequence[Any], info: ModelInfo) -> list[list[int]]:
    if isinstance(prompts, (str, np.ndarray)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            if info.tokenizer is None:
                raise ValueError(f"prompts[{row}] is a string but the model has no tokenizer")
            ids = list(info.tokenizer.encode(p))
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompts[{row}] is empty: a prompt needs at least one token")
        for t in ids:
            if not 0 <= t < info.vocab_size:
                raise ValueError(
                    f"prompts[{row}] holds token id {t}, outside the vocabulary range "
                    f"[0, {info.vocab_size - 1}]"
                )
        out.append(ids)
    return out


def _child_seed(seed: int, child: int) -> int:
    """Seed of sample `child` of a prompt: child 0 keeps the seed, others mix it (splitmix)."""
    if child == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + child * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def prepare(
    model: Any,
    prompts: Sequence[Any],
    params: SamplingParams,
    *,
    n: int = 1,
    ignore_eos: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[ModelInfo, list[list[int]], SamplingParams]:
    """Validate and expand inputs on the host: tokenized prompts and per-row params.

    With a `mesh`, the weights are laid over it and params gain dummy rows up to a
    multiple of the data-axis size (`sharding.shard_inputs`); `ids` keeps the real rows.
    """
    info = model_info(model)
    ids = _tokenize(prompts, info)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
    if params.batch_size != len(ids):
        raise ValueError(
            f"params has batch_size {params.batch_size} but there are {len(ids)} prompts"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n = {n!r} is outside the allowed range [1, inf)")
    params.check_vocab(info.vocab_size)
    max_tokens = np.asarray(params.max_tokens)
    for row, p in enumerate(ids):
        if len(p) + int(max_tokens[row]) > info.max_length:
            raise ValueError(
                f"prompts[{row}] has {len(p)} tokens and max_tokens[{row}] = {max_tokens[row]}: "
                f"together {len(p) + int(max_tokens[row])}, over the model's context of "
                f"{info.max_length} tokens"
            )
    if n > 1:
        rows = [r for r in range(len(ids)) for _ in range(n)]
        seeds = np.asarray(params.seed)
        child_seeds = [_child_seed(int(seeds[r]), i % n) for i, r in enumerate(rows)]
        params = params.take(rows).replace(seed=jnp.asarray(np.asarray(child_seeds, np.uint32)))
        ids = [ids[r] for r in rows]
    if info.eos_token_ids and not ignore_eos:
        params = _with_stop_ids(params, info.eos_token_ids)
    info, params = sharding.shard_inputs(info, params, sharding.as_auto(mesh))
    return info, ids, params


def _with_stop_ids(params: SamplingParams, extra: Sequence[int]) -> SamplingParams:
    """Add the model's EOS ids to every row's stop token ids."""
    old = np.asarray(params.stop_token_ids)
    rows = [[int(t) for t in r if t >= 0] for r in old]
    rows = [r + [e for e in extra if e not in r] for r in rows]
    width = max(old.shape[1], max(len(r) for r in rows))
    width = 1 << (width - 1).bit_length()
    arr = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return params.replace(stop_token_ids=jnp.asarray(arr))


def stop_tables(info: ModelInfo, params: SamplingParams) -> StopStrings | None:
    """Device tables for the rows' stop strings, or None when no row has one."""
    if not any(params.stop):
        return None
    if info.tokenizer is None:
        raise ValueError("stop strings need a model that carries a tokenizer")
    return stop_strings.build(
        params.stop, stop_strings.token_bytes(info.tokenizer, info.vocab_size)
    )


def initial_state(
    info: ModelInfo,
    ids: list[list[int]],
    params: SamplingParams,
    stops: StopStrings | None,
    *,
    buffer_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> DecodeState:
    """Pad the prompts, run prefill and return the state before the loop.

    Rows of `params` past `len(ids)` (a mesh's dummy rows) get row 0's prompt.
    """
    ids = list(ids) + [ids[0]] * (params.batch_size - len(ids))
    batch = len(ids)
    plen = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET)
    if buffer_len is None:
        buffer_len = bucket(int(np.max(np.asarray(params.max_tokens))), MIN_BUFFER_BUCKET)
    prompt = np.zeros((batch, plen), np.int32)
    positions = np.full((batch, plen), -1, np.int32)
    hist = np.full((batch, plen + buffer_len), -1, np.int32)
    for r, p in enumerate(ids):
        prompt[r, plen - len(p) :] = p
        positions[r, plen - len(p) :] = np.arange(len(p))
        hist[r, : len(p)] = p
    lens = np.asarray([len(p) for p in ids], np.int32)
    history = History(jnp.asarray(hist), jnp.asarray(lens), jnp.asarray(lens))
    num_top = MAX_TOP_LOGPROBS if int(np.max(np.asarray(params.logprobs))) > 0 else 0
    return prefill(
        info.runner,
        info.weights,
        jnp.asarray(prompt),
        jnp.asarray(positions),
        jnp.asarray(lens),
        history,
        params.device_only(),
        stops,
        buffer_len=buffer_len,
        num_top=num_top,
        mesh=sharding.as_auto(mesh),
    )


_FINISH_REASON = {
    FINISH_STOP_TOKEN: "stop",
    FINISH_STOP_SEQUENCE: "stop",
    FINISH_STOP_STRING: "stop",
    FINISH_LENGTH: "length",
    FINISH_ERROR: "error",
}


def _text_ids(ids: list[int], finish: int) -> list[int]:
    """Generated ids that make up the text: a matched stop token is not part of it."""
    return ids[:-1] if finish == FINISH_STOP_TOKEN else ids


def row_text(
    tokenizer,
    ids: list[int],
    finish: int,
    stops: Sequence[str],
    include_stop: bool,
    min_tokens: int = 0,
) -> tuple[str, str | None]:
    """Final text of a row and the stop string it was cut at (None if none).

    Only a row that a stop string ended is cut, at the occurrence that ended it: the loop
    counts an occurrence once the row has `min_tokens` tokens, so it must end in the bytes
    of token `min_tokens - 1` or later. With stop=[" "], min_tokens=4 and the tokens
    " allows", " feature", " to", " format", the spaces inside the first three tokens do
    not count: the text is " allows feature to", cut before the space of " format".
    """
    text = stop_strings.detokenize(tokenizer, _text_ids(ids, finish))
    if finish != FINISH_STOP_STRING or not stops:
        return text, None
    head = stop_strings.Detokenizer(tokenizer)
    head.feed(ids[: max(min_tokens - 1, 0)])  # complete characters only: no finish()
    return stop_strings.trim(text, stops, include_stop, after=len(head.text))


def _row_stops(params: SamplingParams, row: int) -> tuple[tuple[str, ...], bool, int]:
    """The row's stop strings, include_stop_str_in_output and min_tokens."""
    stops = params.stop[row] if params.stop else ()
    include = params.include_stop_str_in_output[row] if params.include_stop_str_in_output else False
    return stops, include, int(np.asarray(params.min_tokens)[row])


def _stop_reason(code: int, matched: int, seqs: np.ndarray) -> Any:
    """The stop token id or stop sequence (ids) a row finished on; None for other finishes.

    seqs: the row's [Q, L] stop sequences, right-aligned and -1 padded.
    """
    if code == FINISH_STOP_TOKEN:
        return matched
    if code == FINISH_STOP_SEQUENCE:
        return [int(t) for t in seqs[matched] if t >= 0]
    return None


def collect(
    state: DecodeState, ids: list[list[int]], params: SamplingParams, info: ModelInfo
) -> GenerationResult:
    """Copy a finished state to the host as a `GenerationResult`."""
    tokens, num, finish, matched, lp, raw_lp, top_ids, top_vals = jax.device_get(
        (
            state.tokens,
            state.num_tokens,
            state.finish,
            state.matched,
            state.logprobs,
            state.raw_logprobs,
            state.top_ids,
            state.top_values,
        )
    )
    seqs = np.asarray(params.stop_sequences)
    want_top = np.asarray(params.logprobs)
    result = GenerationResult(
        token_ids=[],
        finish_reason=[],
        stop_reason=[],
        num_tokens=[],
        prompt_token_ids=ids,
        logprobs=[],
        raw_logprobs=[],
        top_logprobs=[] if top_ids.shape[2] else None,
        text=[] if info.tokenizer is not None else None,
        error=[],
    )
    for r in range(len(ids)):
        k = int(num[r])
        code = int(finish[r])
        row_ids = tokens[r, :k].tolist()
        result.token_ids.append(row_ids)
        result.num_tokens.append(k)
        reason = _FINISH_REASON.get(code, "length")
        stop = _stop_reason(code, int(matched[r]), seqs[r])
        if result.text is not None:
            stops, include, min_tokens = _row_stops(params, r)
            text, hit = row_text(info.tokenizer, row_ids, code, stops, include, min_tokens)
            if hit is not None:
                reason, stop = "stop", hit
            result.text.append(text)
        result.finish_reason.append(reason)
        result.stop_reason.append(stop)
        result.error.append(
            "the logits held NaN/inf or every token was masked" if code == FINISH_ERROR else None
        )
        result.logprobs.append(lp[r, :k].tolist())
        result.raw_logprobs.append(raw_lp[r, :k].tolist())
        if result.top_logprobs is not None:
            n_top = int(want_top[r])
            result.top_logprobs.append(
                [
                    {
                        int(i): float(v)
                        for i, v in zip(top_ids[r, j, :n_top], top_vals[r, j, :n_top], strict=True)
                    }
                    for j in range(k)
                ]
            )
    return result


def generate(
    model: Any,
    prompts: Sequence[Any],
    params: SamplingParams,
    *,
    n: int = 1,
    ignore_eos: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerationResult:
    """Generate completions for a batch of prompts, each row under its own settings.

    model: a logitloop NNX model or a `FunctionModel`; prompts: token-id lists or strings
    (with a tokenizer); params: `SamplingParams` with one row per prompt. `n` samples per
    prompt (rows repeated prompt-major; sample i > 0 gets a seed derived from the row's).
    The model's EOS ids join every row's stop ids unless `ignore_eos`.

    A row ends with finish_reason "stop" (a stop token id, stop sequence or stop string
    matched; `stop_reason` says which), "length" (max_tokens) or "error" (its logits held
    NaN/inf or every token was masked). `token_ids` holds every generated token including a
    matched stop token; `text` (when the model has a tokenizer) is the UTF-8 text of those
    tokens without a matched stop token id; a row that a stop string ended is cut before
    the occurrence that ended it (kept with `include_stop_str_in_output`). An occurrence
    ending within the first `min_tokens - 1` tokens does not count, and is kept.

    Prefill and decode are two jit-compiled calls; prompt length and buffer length are
    bucketed to powers of two, so a new prompt length or max_tokens rarely compiles.

    `mesh`: a `jax.sharding.Mesh` with axes "data" (rows) and "model" (weights, KV heads,
    vocabulary) to run sharded, on one host or several (`logitloop.decoding.sharding`);
    the tokens are those of the single-device run.
    """
    mesh = sharding.as_auto(mesh)
    info, ids, params = prepare(model, prompts, params, n=n, ignore_eos=ignore_eos, mesh=mesh)
    stops = stop_tables(info, params)
    state = initial_state(info, ids, params, stops, mesh=mesh)
    state = decode(
        info.runner,
        info.weights,
        state,
        params.device_only(),
        stops,
        jnp.asarray(2**30, jnp.int32),
        mesh=mesh,
    )
    return collect(sharding.host_view(state, mesh), ids, params, info)


@dataclasses.dataclass
class StreamEvent:
    """New output of one row since its previous event."""

    row: int
    text: str  # text delta (empty without a tokenizer)
    token_ids: list[int]  # tokens generated since the previous event
    finish_reason: str | None = None  # set on the row's last event
    stop_reason: Any = None


def stream(
    model: Any,
    prompts: Sequence[Any],
    params: SamplingParams,
    *,
    n: int = 1,
    ignore_eos: bool = False,
    chunk_steps: int = 8,
    mesh: jax.sharding.Mesh | None = None,
) -> Iterator[StreamEvent]:
    """Generate like `generate`, yielding per-row deltas every `chunk_steps` decode steps.

    The loop runs on device in chunks (the same compiled program as `generate`), and the
    host detokenises incrementally. A delta never holds an incomplete UTF-8 sequence, nor
    the tail of the text that could still begin one of the row's stop strings; each row
    ends with one event carrying its finish_reason. Concatenating a row's deltas gives
    exactly `generate(...).text` for that row.
    """
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"chunk_steps = {chunk_steps!r} is outside the allowed range [1, inf)")
    mesh = sharding.as_auto(mesh)
    info, ids, params = prepare(model, prompts, params, n=n, ignore_eos=ignore_eos, mesh=mesh)
    stops = stop_tables(info, params)
    state = initial_state(info, ids, params, stops, mesh=mesh)
    device_params = params.device_only()
    batch = len(ids)
    tok = info.tokenizer
    seen = [0] * batch
    emitted = [""] * batch
    open_rows = set(range(batch))
    detok = [stop_strings.Detokenizer(tok) if tok is not None else None for _ in range(batch)]
    seqs = np.asarray(params.stop_sequences)
    while True:
        tokens, num, finish, matched, step = jax.device_get(
            sharding.host_view(
                (state.tokens, state.num_tokens, state.finish, state.matched, state.step), mesh
            )
        )
        for r in sorted(open_rows):
            k, code = int(num[r]), int(finish[r])
            new = tokens[r, seen[r] : k].tolist()
            seen[r] = k
            stops_r, include, min_r = _row_stops(params, r)
            if code != RUNNING:
                reason = _FINISH_REASON.get(code, "length")
                stop = _stop_reason(code, int(matched[r]), seqs[r])
                text = ""
                if tok is not None:
                    final, hit = row_text(
                        tok, tokens[r, :k].tolist(), code, stops_r, include, min_r
                    )
                    if hit is not None:
                        reason, stop = "stop", hit
                    text = final[len(emitted[r]) :]
                open_rows.discard(r)
                yield StreamEvent(r, text, new, reason, stop)
                continue
            delta = ""
            if tok is not None:
                detok[r].feed(new)
                visible = detok[r].text
                visible = visible[: len(visible) - stop_strings.held_back(visible, stops_r)]
                delta = visible[len(emitted[r]) :]
                emitted[r] = max(visible, emitted[r], key=len)
            if new or delta:
                yield StreamEvent(r, delta, new)
        if not open_rows:
            return
        state = decode(
            info.runner,
            info.weights,
            state,
            device_params,
            stops,
            jnp.asarray(int(step) + chunk_steps, jnp.int32),
            mesh=mesh,
        )
