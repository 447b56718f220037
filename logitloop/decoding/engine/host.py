"""The host side of generation: prompts in, results out, around the device loop.

Every entry point (`generate`, `stream`, `generate_many`, `explain`, the CLI) goes through
these helpers, so prompts are checked once, with one set of messages:

- `tokenize_prompt` / `tokenize_prompts`: strings or token-id lists to checked ids
  (`check_prompt`: the part that needs no model), and
  `check_context`: a prompt and its max_tokens against the model's context;
- `request_rows`: a batch's params checked against the model (vocabulary, context), with
  `n` samples per prompt and the model's EOS ids among the stop ids;
- `prompt_batch`: the prefill layout of a batch of prompts (left padding, bucketed width,
  the history), and `initial_state` which runs the prefill on it;
- `stop_tables`: the device tables of the rows' stop strings;
- `constraint_tables`: the device automata of the rows' constraints and their start states;
- `collect`: a finished batch's `Outputs` (host arrays) to a `GenerationResult`.

The device loop itself (state, prefill, decode, index bookkeeping) is
`logitloop.decoding.loop.decode_loop`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import memory_check
from logitloop.decoding.loop import stop_strings
from logitloop.decoding.loop.decode_loop import (
    FINISH_CONSTRAINT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_REPETITION,
    FINISH_STOP_SEQUENCE,
    FINISH_STOP_STRING,
    FINISH_STOP_TOKEN,
    DecodeState,
    Outputs,
    Program,
    PromptBatch,
    Tables,
    prefill,
)
from logitloop.decoding.loop.runner import ModelInfo
from logitloop.decoding.loop.stop_strings import StopStrings
from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.checks import (
    MAX_TOP_LOGPROBS,
    Widths,
    bucket_width,
    check_text,
    is_token_id,
    row_name,
)
from logitloop.decoding.sampling.constraints import Automata
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams

MIN_PROMPT_BUCKET = 16
MIN_BUFFER_BUCKET = 16
# `generate` and `stream`'s token buffer: at least 64 slots, so the usual short requests
# (max_tokens 1..64) share one program; a decode step reads only the cache's live prefix
# once it is long (`ops.attention.api.PREFIX_FRACTIONS`), and below that the extra slots
# are a few KiB per row and layer.
MIN_GENERATE_BUFFER = 64


def bucket(n: int, minimum: int, *, fine: bool = False) -> int:
    """Round up to a power of two (at least `minimum`) so that new lengths rarely compile.

    `fine`: also to three halves of a power of two where that is a multiple of 16 (48,
    96, 192, 384, ...): a width at most 1.5 times `n` (a power of two pads 257 to 512),
    for one more program per doubling. For passes whose cost grows with the width and
    whose results do not depend on it (`score`'s: a document of 345 tokens runs 384
    columns, not 512)."""
    width = bucket_width(n, minimum)
    three_halves = 3 * width // 4
    if fine and three_halves % 16 == 0 and max(n, minimum) <= three_halves:
        return three_halves
    return width


# What ended a row that finished with "stop", as vLLM's `stop_reason` (`int | str | None`),
# plus logitloop's stop sequences of token ids:
#   int        the stop token id it ended on (one of `stop_token_ids` or the model's EOS ids;
#              vLLM reports None for EOS, logitloop the id),
#   str        the stop string (`stop`) it was cut at,
#   list[int]  the stop sequence (`stop_sequences`) it ended with,
#   None       every other finish: "length", "error", "repetition", or a constraint's
#              complete document.
StopReason = int | str | list[int] | None


@dataclasses.dataclass
class GenerationResult:
    """Host-side results, one entry per row (prompt-major when n > 1).

    `generate`, `stream` (whose events add up to it) and `chat` return one result for the
    batch: each field a list with one entry per row. `generate_many` and
    `iter_generate_many` return one result per request, holding that prompt's `n` rows:
    each field a list of `n` entries, except `text`, which is the request's text itself
    (a str) when `n = 1` and a list of `n` strings when `n > 1`, as in vLLM's outputs;
    `texts` is always the list.
    """

    token_ids: list[list[int]]
    finish_reason: list[str]  # "stop", "length", "repetition" or "error"
    stop_reason: list[StopReason]  # see `StopReason`: an int, str, list of ids or None
    num_tokens: list[int]
    prompt_token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None  # per token, under the final distribution
    raw_logprobs: list[list[float]] | None = None
    # per token {token id: raw logprob} of the row's `logprobs` most likely tokens
    top_logprobs: list[list[dict[int, float]]] | None = None
    text: list[str] | str | None = None  # None without a tokenizer
    error: list[str | None] | None = None
    # with `speculative=`: per row {"cycles", "proposed", "drafted", "accepted"} (`stats`)
    speculation: list[dict[str, int]] | None = None
    # with `prompt_logprobs=`: per row the `ll.score` (`ScoreResult`) of its prompt tokens
    prompt_logprobs: list[Any] | None = None
    # with `return_routing=True` (a mixture of experts): per row an int32 array
    # [len(prompt_token_ids) + len(token_ids), L, k], the k experts each of the L routed
    # layers sent each token to, aligned with prompt + completion as `ll.token_logprobs`
    # takes them (`routing=`); -1 for the last generated token, which no pass fed back
    routing: list[np.ndarray] | None = None
    # with `capture=ll.Capture(...)`: per row a float32 array [T, C, E], the residual
    # stream at the captured layers (`ll.Capture` says which tokens T covers)
    captured: list[np.ndarray] | None = None

    @property
    def texts(self) -> list[str] | None:
        """`text` as a list with one entry per row, whichever entry point made the result."""
        return [self.text] if isinstance(self.text, str) else self.text

    def per_request(self) -> GenerationResult:
        """This result of one request with `text` as the request's own: a str for one row."""
        if isinstance(self.text, list) and len(self.text) == 1:
            return dataclasses.replace(self, text=self.text[0])
        return self


# ----------------------------------------------------------------------------- host side


def check_prompt(name: str, prompt: Any) -> None:
    """What `tokenize_prompt` checks before it needs the model: `prompt` is valid text (a
    string) or a non-empty list of token ids. `name` names it in error messages."""
    if isinstance(prompt, str):
        check_text(name, prompt)
    elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, np.ndarray) and prompt.ndim == 1):
        for t in prompt:
            if not is_token_id(t):
                raise ValueError(f"{name} holds {t!r}, which is not a token id (an int)")
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
    else:
        hint = " (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""
        raise ValueError(
            f"{name} must be a string or a list of token ids, got {type(prompt).__name__}{hint}"
        )


def tokenize_prompt(name: str, prompt: Any, info: ModelInfo) -> list[int]:
    """One prompt (a string, with a tokenizer, or a list of token ids) as checked ids.

    `name` names the prompt in error messages ("prompts[3]", "the prompt").
    """
    check_prompt(name, prompt)
    if isinstance(prompt, str):
        if info.tokenizer is None:
            raise ValueError(f"{name} is a string but the model has no tokenizer")
        ids = list(info.tokenizer.encode(prompt))
        if not ids:
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
    else:
        ids = [int(t) for t in prompt]
    for t in ids:
        if not 0 <= t < info.vocab_size:
            raise ValueError(
                f"{name} holds token id {t}, outside the vocabulary range "
                f"[0, {info.vocab_size - 1}]"
            )
    return ids


def check_context(
    name: str, ids: Sequence[int], max_tokens: int, info: ModelInfo, knob: str = "max_tokens"
) -> None:
    """A ValueError unless the prompt `ids` (named `name`) and `max_tokens` more tokens
    (`knob` names that value: "max_tokens[2]") fit in the model's context."""
    if len(ids) + max_tokens > info.max_length:
        raise ValueError(
            f"{name} has {len(ids)} tokens and {knob} = {max_tokens}: together "
            f"{len(ids) + max_tokens}, over the model's context of {info.max_length} tokens"
        )


def tokenize_prompts(prompts: Sequence[Any], info: ModelInfo) -> list[list[int]]:
    """A batch of prompts (`generate`'s `prompts`) as checked ids, one list per prompt."""
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
    return [tokenize_prompt(f"prompts[{row}]", p, info) for row, p in enumerate(prompts)]


def check_count(name: str, value: Any, lo: int, hi: float = float("inf")) -> int:
    """An int argument (`n`, `slots`, `chunk_steps`, ...) in [lo, hi], or a ValueError."""
    top = "inf)" if hi == float("inf") else f"{int(hi)}]"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{name} must be an int in [{lo}, {top}, got {type(value).__name__} {value!r}"
        )
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value!r} is outside the allowed range [{lo}, {top}")
    return int(value)


def request_rows(
    info: ModelInfo,
    ids: list[list[int]],
    params: Any,
    *,
    n: int = 1,
    ignore_eos: bool = False,
    names: Sequence[str] | None = None,
    processors: Sequence[Any] | None = None,
) -> tuple[list[list[int]], SamplingParams]:
    """Check `params` against the prompts and the model; expand to `n` samples per prompt.

    Returns the prompts and params row by row (prompt-major when n > 1; sample i > 0 gets a
    seed derived from the row's), the model's EOS ids among every row's stop ids unless
    `ignore_eos`. `names` name the prompts in error messages (default "prompts[i]").
    `processors` (when given) replace `params.processors`; their rows go with the params'.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
    params = params.broadcast_to(len(ids))
    check_count("n", n, 1)
    if processors is not None:
        params = params.replace(processors=procs.as_tuple(processors, params.batch_size))
    params.check_vocab(info.vocab_size)
    max_tokens = np.asarray(params.max_tokens)
    for row, p in enumerate(ids):
        name = names[row] if names is not None else f"prompts[{row}]"
        check_context(name, p, int(max_tokens[row]), info, row_name("max_tokens", row, len(ids)))
    params = params.samples(n)
    ids = [p for p in ids for _ in range(n)]
    if info.eos_token_ids and not ignore_eos:
        params = params.with_stop_token_ids(info.eos_token_ids)
    return ids, params


def stop_tables(
    info: ModelInfo,
    stop: Sequence[Sequence[str]],
    widths: Widths | None = None,
    *,
    always: bool = False,
    rows: int | None = None,
) -> StopStrings | None:
    """Device tables for the rows' stop strings (`SamplingParams.stop`, () when no row has
    one: then `rows` rows), at least `widths` wide; None when no row has one and neither
    `widths` nor `always` asks for tables."""
    if not any(stop) and not always and (widths is None or not widths.stop_strings):
        return None
    if not stop:
        stop = ((),) * rows
    if info.tokenizer is None:
        raise ValueError("stop strings need a model that carries a tokenizer")
    return stop_strings.build(
        stop, stop_strings.token_bytes(info.tokenizer, info.vocab_size), widths
    )


def constraint_vocabulary(info: ModelInfo) -> constraints.TokenVocabulary:
    """The model's vocabulary for the constraints' automata (cached per tokenizer)."""
    if info.tokenizer is None:
        raise ValueError("json_schema, regex and choice need a model that carries a tokenizer")
    return constraints.vocabulary(info.tokenizer, info.vocab_size, info.eos_token_ids)


def constraint_tables(
    info: ModelInfo, params: SamplingParams
) -> tuple[Automata | None, np.ndarray | None]:
    """The rows' automata packed into device tables and each row's initial state ([B] i32,
    -1 unconstrained); (None, None) when no row has a constraint. Raises ValueError naming
    the row when the vocabulary cannot spell any document its constraint accepts."""
    if not params.constraints:
        return None, None
    vocab = constraint_vocabulary(info)
    constraints.refuse_stop_ids(params.constraints, np.asarray(params.stop_token_ids), vocab)
    return constraints.tables(params.constraints, vocab)


def pad_prompts(
    ids: Sequence[Sequence[int]], prompt_len: int, capacity: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The prefill layout of a batch of prompts (see `loop.py`'s docstring), on the host.

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


def prompt_batch(
    ids: Sequence[Sequence[int]], buffer_len: int, prompt_len: int | None = None
) -> PromptBatch:
    """The prefill layout of `ids` with room for `buffer_len` generated tokens; the prompt
    width is `prompt_len`, by default the longest prompt's length bucketed."""
    if prompt_len is None:
        prompt_len = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET)
    prompt, positions, hist, lens = pad_prompts(ids, prompt_len, prompt_len + buffer_len)
    return PromptBatch(prompt, positions, lens, History(hist, lens, lens))


def suffix_batch(batch: PromptBatch, cached: np.ndarray) -> PromptBatch:
    """`batch` ([G] rows, from `prompt_batch`) for a prefill after each row's first
    `cached[g]` prompt tokens, whose keys and values a paged pool already holds: the
    columns before them become padding and the width shrinks to the longest rest,
    bucketed (the prefill computes only the rest; `lengths` and `history` stay whole)."""
    rest = int(np.max(np.asarray(batch.lengths) - cached))
    width = min(bucket(max(rest, 1), MIN_PROMPT_BUCKET), batch.prompt.shape[1])
    positions = np.asarray(batch.positions)[:, -width:]
    positions = np.where(positions < np.asarray(cached)[:, None], -1, positions)
    return batch.replace(
        prompt=np.asarray(batch.prompt)[:, -width:], positions=positions.astype(np.int32)
    )


def buffer_for(params: SamplingParams) -> int:
    """The generation buffer of a batch: its largest max_tokens, bucketed (at least
    `MIN_GENERATE_BUFFER`)."""
    return bucket(int(np.max(np.asarray(params.max_tokens))), MIN_GENERATE_BUFFER)


def row_bucket(rows: int, multiple: int = 1) -> int:
    """The rows a batch of `rows` prompts runs: a power of two or three halves of one from
    48 on (1, 2, 4, 8, 16, 32, 48, 64, 96, ...; `bucket(fine=True)`), rounded up to a
    multiple of `multiple` (a mesh's data axis)."""
    rows = bucket(rows, 1, fine=True)
    return -(-rows // multiple) * multiple


def top_logprobs_bucket(params: SamplingParams) -> int:
    """The width the loop computes the top logprobs at: 0 when no row asks for any, else
    `MAX_TOP_LOGPROBS` (one program for every width; `collect` keeps each row's own n)."""
    return MAX_TOP_LOGPROBS if params.top_logprobs_width else 0


def fill_rows(ids: list[list[int]], rows: int) -> list[list[int]]:
    """The prompts of a batch of `rows` rows: `ids`, then row 0's prompt for each dummy row
    (`SamplingParams.with_dummy_rows`)."""
    return list(ids) + [ids[0]] * (rows - len(ids))


def initial_state(
    program: Program, tables: Tables, ids: list[list[int]], **options: Any
) -> DecodeState:
    """Pad the prompts `ids`, run prefill and return the state before the loop.

    `options`: `prefill_call`'s (`fsm`, `buffer_len`, `prompt_len`, `prefill_chunk`)."""
    fn, args, kwargs = prefill_call(program, tables, ids, **options)
    return memory_check.checked_call("prompts", args[2].prompt.size, fn, *args, **kwargs)


def prefill_call(
    program: Program,
    tables: Tables,
    ids: list[list[int]],
    *,
    fsm: np.ndarray | None = None,
    buffer_len: int | None = None,
    prompt_len: int | None = None,
    prefill_chunk: int | None = None,
) -> tuple[Any, tuple, dict[str, Any]]:
    """The prefill `initial_state` runs, as (jitted function, arguments, keywords): what
    `precompile` compiles ahead of time for the same batch.

    `fsm`: the rows' initial automaton states (`constraint_tables`). Rows of the tables past
    `len(ids)` (dummy rows, `Plan.rows`) get row 0's prompt. `buffer_len`: room for generated
    tokens (default: the rows' largest max_tokens, bucketed). `prompt_len`: the prompt
    width (default: the longest prompt's bucket). `prefill_chunk`: run the prompt columns
    through the model that many at a time (`loop.forward_prompt`) instead of in one pass."""
    if prefill_chunk is not None:
        check_count("prefill_chunk", prefill_chunk, 1)
    params = tables.params
    ids = fill_rows(ids, params.batch_size)
    buffer_len = buffer_for(params) if buffer_len is None else buffer_len
    num_top = params.top_logprobs_width
    batch = prompt_batch(ids, buffer_len, prompt_len)
    keywords = dict(buffer_len=buffer_len, num_top=num_top, prefill_chunk=prefill_chunk)
    return prefill, (program, tables, batch, fsm), keywords


FINISH_REASON = {
    FINISH_STOP_TOKEN: "stop",
    FINISH_STOP_SEQUENCE: "stop",
    FINISH_STOP_STRING: "stop",
    FINISH_CONSTRAINT: "stop",
    FINISH_LENGTH: "length",
    FINISH_ERROR: "error",
    # The repetition guard cut the row (`repetition_guard`); its tokens and text keep
    # everything generated, the repeats included.
    FINISH_REPETITION: "repetition",
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


def row_stops(params: SamplingParams, row: int) -> tuple[tuple[str, ...], bool, int]:
    """The row's stop strings, include_stop_str_in_output and min_tokens."""
    stops = params.stop[row] if params.stop else ()
    include = params.include_stop_str_in_output[row] if params.include_stop_str_in_output else False
    return stops, include, int(np.asarray(params.min_tokens)[row])


def stop_reason(code: int, matched: int, seqs: np.ndarray) -> Any:
    """The stop token id or stop sequence (ids) a row finished on; None for other finishes.

    seqs: the row's [Q, L] stop sequences, right-aligned and -1 padded.
    """
    if code == FINISH_STOP_TOKEN:
        return matched
    if code == FINISH_STOP_SEQUENCE:
        return [int(t) for t in seqs[matched] if t >= 0]
    return None


def collect(
    outputs: Outputs, ids: list[list[int]], params: SamplingParams, info: ModelInfo
) -> GenerationResult:
    """A finished batch's outputs (`DecodeState.outputs()`, on device or host) as a
    `GenerationResult`: rows `0 .. len(ids) - 1`, under `params`' rows."""
    out = jax.device_get(outputs)
    tokens, num, finish, matched = out.tokens, out.num_tokens, out.finish, out.matched
    lp, raw_lp, top_ids, top_vals = out.logprobs, out.raw_logprobs, out.top_ids, out.top_values
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
        reason = FINISH_REASON.get(code, "length")
        stop = stop_reason(code, int(matched[r]), seqs[r])
        if result.text is not None:
            stops, include, min_tokens = row_stops(params, r)
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
