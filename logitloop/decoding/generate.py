"""The host side of generation: prompts in, results out, around the device loop.

`generate` and `stream` tokenize and validate the prompts (`prepare`), pad them and run the
prefill (`initial_state`), run the device loop (`logitloop.decoding.loop`: the state, the
index bookkeeping, prefill and decode), and copy the finished rows to the host (`collect`).
`generate_many` (`batching.py`) and `explain` use the same helpers"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding import sharding, stop_strings
from logitloop.decoding.history import History
from logitloop.decoding.loop import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP_SEQUENCE,
    FINISH_STOP_STRING,
    FINISH_STOP_TOKEN,
    RUNNING,
    DecodeState,
    decode,
    prefill,
)
from logitloop.decoding.model import ModelInfo, model_info
from logitloop.decoding.params import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    bucket_width,
    check_text,
    is_token_id,
)
from logitloop.decoding.stop_strings import StopStrings

MIN_PROMPT_BUCKET = 16
MIN_BUFFER_BUCKET = 16


def bucket(n: int, minimum: int) -> int:
    """Round up to a power of two (at least `minimum`) so that new lengths rarely compile."""
    return bucket_width(n, minimum)


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


# ----------------------------------------------------------------------------- host side


def _tokenize(prompts: Sequence[Any], info: ModelInfo) -> list[list[int]]:
    if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts must be a list of strings or a list of token-id lists, "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    if all(is_token_id(p) for p in prompts):
        raise ValueError(
            "prompts is a flat list of token ids: pass a list of prompts, e.g. [[1, 2, 3]] "
            "for one prompt"
        )
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            check_text(f"prompts[{row}]", p)
            if info.tokenizer is None:
                raise ValueError(f"prompts[{row}] is a string but the model has no tokenizer")
            ids = list(info.tokenizer.encode(p))
        elif isinstance(p, (list, tuple)) or (isinstance(p, np.ndarray) and p.ndim == 1):
            for t in p:
                if not is_token_id(t):
                    raise ValueError(
                        f"prompts[{row}] holds {t!r}, which is not a token id (an int)"
                    )
            ids = [int(t) for t in p]
        else:
            hint = " (decode bytes to str first)" if isinstance(p, (bytes, bytearray)) else ""
            raise ValueError(
                f"prompts[{row}] must be a string or a list of token ids, got "
                f"{type(p).__name__}{hint}"
            )
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
    width = bucket_width(max(old.shape[1], max(len(r) for r in rows)))
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


def pad_prompts(
    ids: Sequence[Sequence[int]], prompt_len: int, capacity: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prefill layout of a batch of prompts (see the module docstring), on the host.

    Returns prompt [B, P] (left-padded with 0), positions [B, P] (-1 on padding), the
    history's tokens [B, capacity] (each prompt from column 0, -1 after) and lengths [B].
    """
    batch = len(ids)
    prompt = np.zeros((batch, prompt_len), np.int32)
    positions = np.full((batch, prompt_len), -1, np.int32)
    hist = np.full((batch, capacity), -1, np.int32)
    for r, p in enumerate(ids):
        prompt[r, prompt_len - len(p) :] = p
        positions[r, prompt_len - len(p) :] = np.arange(len(p))
        hist[r, : len(p)] = p
    return prompt, positions, hist, np.asarray([len(p) for p in ids], np.int32)


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
    plen = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET)
    if buffer_len is None:
        buffer_len = bucket(int(np.max(np.asarray(params.max_tokens))), MIN_BUFFER_BUCKET)
    prompt, positions, hist, lens = pad_prompts(ids, plen, plen + buffer_len)
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
