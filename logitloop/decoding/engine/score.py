"""`score`: the log-probability of given continuations, one forward pass per batch.

For every pair (prompt, continuation) and every continuation token, `score` reports its
log-probability under the model (`raw_logprobs`: the float32 log-softmax of the logits,
as `generate` reports `raw_logprobs`) and, with `params`, under the row's processed
distribution at that position (`logprobs`: the sampler's own steps 1-7, `sampler.
adjust_logits` and the truncation thresholds, with the history as it is at that
position; -inf where a mask or filter removes the token), the top-n raw alternatives,
and whether each token was the model's argmax.

Index bookkeeping, for one row with prompt [a, b, c] and continuation [x, y, z], the
prompt bucketed to P = 4 columns and the continuation to C = 4:

    prompt pass      [pad, a, b, c]   positions [-1, 0, 1, 2]   -> logits of column 3: x
    continuation     [x, y, pad]      positions [3, 4, -1]      -> logits of x: y, of y: z

so the continuation pass feeds C - 1 columns (its last token is never fed) and the logits
of continuation token j are the prompt pass's last column (j = 0) or column j - 1 of the
continuation pass. The two calls are those of `generate`: prompt tokens go through a
prompt pass and continuation tokens through a pass over generated tokens (a speculative
verification's `forward_columns`), so with `deterministic=True` every logit, and so every
log-probability, is bit for bit the one `generate` computed for the tokens it drew. The LM
head runs on the continuation's positions only.

Pairs with the same prompt ids (a multiple-choice question's choices) share its prompt
pass: a batch runs the prompt pass over its K distinct prompts only, and each row takes
its prompt's last-column logits and KV cache by gathering row `row_prompt[b]` of them
(`shared_prompts`), as `generate(n=...)` prefills each prompt once for its n rows. A
row's values are those of its pair scored alone; with `deterministic=True` bit for bit
(the prompt pass's rows do not depend on the other rows).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import reuse
from logitloop.decoding.engine.host import (
    MIN_PROMPT_BUCKET,
    bucket,
    check_count,
    check_prompt,
    constraint_tables,
    prompt_batch,
    row_bucket,
    tokenize_prompt,
)
from logitloop.decoding.engine.inside import Capture
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.loop.decode_loop import forward_prompt
from logitloop.decoding.loop.layout import ONE_DEVICE, Layout
from logitloop.decoding.loop.runner import (
    ModelInfo,
    ModelRunner,
    runner_jit,
)
from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from logitloop.decoding.sampling.sampler import STATUS_OK, adjust_logits, raw_normalizer
from logitloop.models.kv import Rows
from logitloop.ops.sampling.noise import row_keys
from logitloop.ops.sampling.xla import filter_and_sample as xla_filter_and_sample
from logitloop.ops.sampling.xla import first_argmax, scale_logits

MIN_CONTINUATION_BUCKET = 4
NEG_INF = float("-inf")


@dataclasses.dataclass
class ScoreResult:
    """The scores of one continuation given its prompt, one entry per continuation token."""

    token_ids: list[int]  # the continuation's tokens
    prompt_token_ids: list[int]
    raw_logprobs: list[float]  # log_softmax(model logits)[token], float32
    is_argmax: list[bool]  # the token is the model's argmax (ties to the lowest id)
    logprobs: list[float] | None = None  # under the row's processed distribution (`params`)
    top_logprobs: list[dict[int, float]] | None = None  # top-n raw alternatives per position
    text: str | None = None  # the continuation's text (with a tokenizer)
    # None, or what went wrong: the model's logits held NaN or +inf, or were -inf for every
    # token, at some position (its raw_logprobs there are -inf, as generate's finish
    # reason is "error" for such a row)
    error: str | None = None
    # with `capture=`: [len(token_ids), C, E] float32, the residual stream at the captured
    # layers at the position each token was predicted from (docs/inside.md)
    captured: np.ndarray | None = None

    @property
    def raw_logprob_sum(self) -> float:
        """The continuation's log-likelihood under the model (lm-evaluation-harness's)."""
        return float(np.sum(np.asarray(self.raw_logprobs, np.float64)))

    @property
    def logprob_sum(self) -> float | None:
        """The sum under the processed distributions (-inf if a filter removed a token)."""
        if self.logprobs is None:
            return None
        return float(np.sum(np.asarray(self.logprobs, np.float64)))

    @property
    def is_greedy(self) -> bool:
        """Every token was the argmax: greedy decoding would have produced the continuation."""
        return all(self.is_argmax)


# ----------------------------------------------------------------------------- host side


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """A (context, continuation) pair of strings as token ids, as lm-evaluation-harness
    splits it (`_encode_pair`): trailing whitespace of the context moves to the front of
    the continuation; the continuation's ids are those of `encode(context + continuation)`
    after the first `len(encode(context))` ids; the context's are `encode(context)`.

    So "Question: 2+2=" / " 4" scores the ids the whole text tokenizes to after the
    context's, which is how the continuation appears in running text (a leading space
    merged into its first token). Returns (context ids, continuation ids).
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(tokenizer.encode(context + continuation))
    ctx = list(tokenizer.encode(context))
    return ctx, whole[len(ctx) :]


def score_pairs(
    prompts: Sequence[Any], continuations: Sequence[Any], info: ModelInfo
) -> tuple[list[list[int]], list[list[int]]]:
    """Checked (prompt ids, continuation ids) per pair; strings tokenized in context."""
    for name, value in (("prompts", prompts), ("continuations", continuations)):
        if isinstance(value, (str, bytes, np.ndarray)) or not isinstance(value, Sequence):
            raise ValueError(
                f"{name} must be a list of strings or of token-id lists, got {type(value).__name__}"
            )
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one (prompt, continuation) pair")
    if len(prompts) != len(continuations):
        raise ValueError(
            f"prompts has {len(prompts)} entries but continuations has {len(continuations)}: "
            "one continuation per prompt"
        )
    out_p, out_c = [], []
    for row, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        name = f"continuations[{row}]"
        if isinstance(c, str) and c == "":
            raise ValueError(f"{name} is empty: a continuation needs at least one token")
        if not isinstance(c, str):
            if isinstance(c, (list, tuple, np.ndarray)) and len(c) == 0:
                raise ValueError(f"{name} is empty: a continuation needs at least one token")
            check_prompt(name, c)
        if isinstance(c, str):
            if not isinstance(p, str):
                raise ValueError(
                    f"{name} is a string but prompts[{row}] is token ids: a string continuation "
                    "is tokenized in the context of its prompt's text, so pass both as strings "
                    "(or both as token ids)"
                )
            if info.tokenizer is None:
                raise ValueError(f"{name} is a string but the model has no tokenizer")
            check_prompt(f"prompts[{row}]", p)
            ctx, cont = encode_pair(info.tokenizer, p, c)
            if not ctx:
                raise ValueError(f"prompts[{row}] is empty: a prompt needs at least one token")
            if not cont:
                raise ValueError(f"{name} tokenizes to no tokens after its prompt")
            p, c = ctx, cont
        ids = tokenize_prompt(f"prompts[{row}]", p, info)
        cont = tokenize_prompt(name, c, info)
        # The continuation's last token is scored but never fed: the model sees
        # len(ids) + len(cont) - 1 positions (lm-evaluation-harness's windows use them all).
        if len(ids) + len(cont) - 1 > info.max_length:
            raise ValueError(
                f"{name} has {len(cont)} tokens and prompts[{row}] {len(ids)}: together "
                f"{len(ids) + len(cont)}, over the model's context of {info.max_length} "
                "tokens plus the last continuation token, which is never fed"
            )
        out_p.append(ids)
        out_c.append(cont)
    return out_p, out_c


def score(
    model: Any,
    prompts: Sequence[Any],
    continuations: Sequence[Any],
    params: SamplingParams | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    deterministic: bool | str = False,
    top_logprobs: int = 0,
    batch_size: int = 16,
    processors: Sequence[Any] | None = None,
    progress: Callable[[int, int], Any] | None = None,
    share_prompts: bool = True,
    adapters: Any = None,
    adapter: Any = None,
    capture: Any = None,
) -> list[ScoreResult]:
    """Score each continuation given its prompt: one forward pass per batch, no decode loop.

    prompts, continuations: one continuation per prompt, as token-id lists, or as strings
    (with a tokenizer) split as lm-evaluation-harness does (`encode_pair`: trailing
    whitespace of the prompt moves to the continuation, whose ids are those of the whole
    text after the prompt's). A string prompt with an id continuation is tokenized alone.

    For each continuation token (`ScoreResult`): `raw_logprobs`, the float32 log-softmax
    of the model's logits at that position (the values `generate` reports as
    `raw_logprobs`); with `params` (one row per pair) `logprobs`, the log-probability under
    the row's processed distribution, the sampler's steps 1-7 with the continuation's
    earlier tokens as the generated ones (`min_tokens` counts them; penalties, processors
    and constraints see the history as it is at that position), -inf where a mask or a
    filter removes the token; greedy rows give 0 at the argmax and -inf elsewhere. The
    model's EOS ids join every row's stop ids, as in `generate`. For the token the row's
    own draw picks at that position (what `generate` drew) the value is the sampler's bit
    for bit; for others it may differ from it in the last bit.
    `top_logprobs` (0..MAX_TOP_LOGPROBS): that many raw alternatives per position. A
    position whose logits hold NaN or +inf, or are -inf for every token, scores -inf and
    sets the result's `error` (naming the positions), where `generate` would end the row
    with finish reason "error".

    The pairs run in batches of `batch_size` rows, longest first; the rows, the prompt and
    continuation widths and a batch's distinct prompts are bucketed (`score_rows`,
    `host.bucket`, `shared_prompts`; docs/scoring.md, "What compiles"), so few programs
    compile and a new length or row count inside a bucket compiles none, and
    `progress(done, total)` is called after each batch. Pairs whose prompts are the same
    ids run in the same batch and share one prompt pass (module docstring); with
    `share_prompts=False` every pair runs its own (the values are the same, with
    `deterministic=True` bit for bit). `mesh`, `deterministic`: as in `generate`; with
    `deterministic=True` the values are bit for bit those `generate` reports for the same
    tokens. `adapters`, `adapter`: LoRA adapters (`ll.load_adapter`) and each pair's
    adapter by name, one for all or one per pair (None: the base), as in `generate`;
    pairs under adapters run their own prompt passes (no sharing yet). `capture`: an
    `ll.Capture` (not with `mesh`): each result's `captured`, `[len(continuation), C, E]`
    float32, the residual stream at the captured layers at the token each continuation
    token was predicted from (the prompt's last, then the continuation's own; as
    `generate`'s without `prompt=True`, which `score` refuses; docs/inside.md).
    """
    check_count("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    options = Options(mesh=mesh, deterministic=deterministic, adapters=adapters, adapter=adapter)
    job = plan(model, options, adapters=True)
    layers = score_capture(capture, job)
    info, layout = job.info, job.layout
    check_count("batch_size", batch_size, 1)
    batch_size = -(-batch_size // layout.row_multiple) * layout.row_multiple
    ids, conts = score_pairs(prompts, continuations, info)
    total = len(ids)
    slots = None if adapters is None else adapters.slots(adapter, total)
    share_prompts = share_prompts and slots is None
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
        params = params.broadcast_to(total, "pairs")
        if processors is not None:
            params = params.replace(processors=procs.as_tuple(processors, total))
        params.check_vocab(info.vocab_size)
        if info.eos_token_ids:
            params = params.with_stop_token_ids(info.eos_token_ids)
    elif processors is not None:
        raise ValueError("processors act on the processed distribution: pass params with them")
    order = pair_order(ids, conts, share_prompts)
    results: list[ScoreResult | None] = [None] * total
    # The programs' key besides the buckets (`reuse`): a call reuses the buckets of an
    # earlier one that cover its own.
    key = ("score", info.runner, layout, top_logprobs, params is not None, slots is not None,
           layers)  # fmt: skip
    for start in range(0, total, batch_size):
        rows = order[start : start + batch_size]
        width = batch_size if total > batch_size else score_rows(len(rows), batch_size, layout)
        out = _score_rows(
            info, [ids[r] for r in rows], [conts[r] for r in rows],
            None if params is None else params.take(rows), top_logprobs, layout,
            share_prompts, rows=width, key=key,
            adapters=None if slots is None else (adapters, slots[rows]), capture=layers,
        )  # fmt: skip
        for i, r in enumerate(rows):
            results[r] = _result(out, i, ids[r], conts[r], top_logprobs, params is not None, info)
            if layers:
                results[r].captured = np.asarray(out["captured"][i, : len(conts[r])])
        if progress is not None:
            progress(min(start + batch_size, total), total)
    return results


def score_capture(capture: Any, job: Any) -> tuple[int, ...]:
    """The layers `score(capture=)` records (`ll.residual`'s numbers), () without it;
    checked by name before anything runs."""
    if capture is None:
        return ()
    if not isinstance(capture, Capture):
        raise ValueError(f"capture must be an ll.Capture(layers=...), got {type(capture).__name__}")
    if capture.prompt or job.options.mesh is not None:
        raise NotImplementedError(
            "score(capture=) records the continuation's positions only, on one device: "
            "Capture(prompt=True) and mesh= are not done yet (docs/inside.md)"
        )
    return capture.model_layers(job.num_layers)


def score_rows(rows: int, batch_size: int, layout: Layout) -> int:
    """The rows a call of `rows` pairs, all in one batch, runs: `host.row_bucket` (a power
    of two or three halves of one, a multiple of the layout's data shards), at most
    `batch_size` (already such a multiple). A call of several batches runs every batch at
    `batch_size` rows (its last one too: one program for all of them). Padding rows repeat
    the batch's first pair; a row's values do not depend on them (with `deterministic=True`
    bit for bit)."""
    return min(batch_size, row_bucket(rows, layout.row_multiple))


def pair_order(ids: list[list[int]], conts: list[list[int]], share: bool) -> list[int]:
    """The pairs' batch order: longest first (few, tight buckets); with `share` the pairs
    of one prompt next to each other, so that they fall in the same batch and share its
    prompt pass (prompts ordered by their longest pair)."""
    longest = sorted(range(len(ids)), key=lambda r: -(len(ids[r]) + len(conts[r])))
    if not share:
        return longest
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in longest:  # dicts keep insertion order: each prompt where its longest pair is
        groups.setdefault(tuple(ids[r]), []).append(r)
    return [r for rows in groups.values() for r in rows]


def shared_prompts(
    ids: list[list[int]], row_multiple: int = 1, width: int | None = None
) -> tuple[list[list[int]], np.ndarray] | None:
    """The distinct prompts of a batch's rows and each row's index among them
    (`row_prompt`, [B] i32), or None where sharing saves no row. The distinct prompts are
    padded (with the first) to a power of two, a multiple of `row_multiple` (a mesh's
    data shards) and at most the batch's rows, so few programs compile; or to `width`."""
    index: dict[tuple[int, ...], int] = {}
    row_prompt = np.asarray([index.setdefault(tuple(p), len(index)) for p in ids], np.int32)
    distinct = [list(p) for p in index]
    if width is None:
        width = -(-bucket(len(distinct), 1) // row_multiple) * row_multiple
    if width >= len(ids) or width < len(distinct):
        return None
    return distinct + [distinct[0]] * (width - len(distinct)), row_prompt


def prompt_scores(
    model: Any,
    ids: list[list[int]],
    num_top: int,
    mesh: jax.sharding.Mesh | None = None,
    deterministic: bool | str = False,
) -> list[ScoreResult]:
    """`generate(..., prompt_logprobs=n)`: each prompt's tokens after its first, scored
    given the first (a one-token prompt gets an empty `ScoreResult`)."""
    rows = [r for r, p in enumerate(ids) if len(p) > 1]
    out = [ScoreResult([], list(p), [], [], top_logprobs=[] if num_top else None) for p in ids]
    if rows:
        scored = score(
            model, [ids[r][:1] for r in rows], [ids[r][1:] for r in rows],
            mesh=mesh, deterministic=deterministic, top_logprobs=num_top,
        )  # fmt: skip
        for r, s in zip(rows, scored, strict=True):
            out[r] = s
    return out


def _score_rows(
    info: ModelInfo,
    ids: list[list[int]],
    conts: list[list[int]],
    params: SamplingParams | None,
    num_top: int,
    layout: Layout,
    share_prompts: bool = False,
    *,
    rows: int | None = None,
    key: Any = None,
    adapters: tuple[Any, np.ndarray] | None = None,
    capture: tuple[int, ...] = (),
) -> dict[str, np.ndarray]:
    """One batch on device; host arrays [B, C] (and [B, C, K] for the alternatives), B the
    batch's `rows` (default its pairs; padded with its first pair). `key`: the programs'
    key in `reuse` (None: the buckets the batch needs, no reuse). `adapters`: the
    `ll.Adapters` and each pair's slot. `capture`: the layers to record (`Rows.capture`),
    then `out["captured"]` [B, C, len(capture), E]."""
    shape = need = _score_shape(ids, conts, rows or len(ids), share_prompts, layout)
    if key is not None:
        key = (*key, need.distinct > 0)  # a shared prompt pass is a program of its own
        shape = reuse.fit(key, need)
        if shape.distinct >= shape.rows > 1:  # sharing must save rows
            shape = need
        reuse.ran(key, shape)
    pad = shape.rows - len(ids)
    ids, conts = ids + [ids[0]] * pad, conts + [conts[0]] * pad
    if params is not None and pad:
        params = params.take(list(range(len(ids) - pad)) + [0] * pad)
    width, plen = shape.cont, shape.prompt
    # The cache holds the prompt bucket and at least MIN_PROMPT_BUCKET more slots, as
    # `generate`'s does (a multiple of the deterministic attention's slot chunk).
    buffer = bucket(width, MIN_PROMPT_BUCKET, fine=True)
    batch = prompt_batch(ids, buffer, plen)  # the rows' lengths and histories
    prompt, positions, row_prompt = batch.prompt, batch.positions, None
    if shape.distinct:
        distinct, row_prompt = shared_prompts(ids, layout.row_multiple, shape.distinct)
        pass_batch = prompt_batch(distinct, buffer, plen)
        prompt, positions = pass_batch.prompt, pass_batch.positions
    cont = np.zeros((len(ids), width), np.int32)
    for r, c in enumerate(conts):
        cont[r, : len(c)] = c
    lengths = np.asarray([len(c) for c in conts], np.int32)
    automata = fsm = None
    if params is not None:
        automata, fsm = constraint_tables(info, params)
        params = params.device_only()
    row_state = None
    if adapters is not None:
        table, slots = adapters
        slots = np.concatenate([slots, np.full(pad, -1, np.int32)])
        row_state = Rows(jnp.asarray(slots, jnp.int32), table.table)
    if capture:
        row_state = (row_state or Rows()).replace(capture=capture)
    out = score_batch(
        info.runner, info.weights, prompt, positions, batch.lengths, batch.history,
        cont, lengths, params, automata, fsm, row_prompt, row_state, num_top=num_top,
        layout=layout,
    )  # fmt: skip
    return jax.device_get(layout.host_view(out))


@dataclasses.dataclass(frozen=True)
class ScoreShape:
    """The buckets a scoring batch runs at: `rows` pairs, `cont` continuation columns (1:
    the prompt pass alone), `prompt` prompt columns, and `distinct` prompt-pass rows when
    the batch's pairs share prompts (0: every row its own pass, `shared_prompts`)."""

    rows: int
    cont: int
    prompt: int
    distinct: int


def _score_shape(
    ids: list[list[int]], conts: list[list[int]], rows: int, share: bool, layout: Layout
) -> ScoreShape:
    """The buckets a batch of these pairs needs, padded to `rows` rows."""
    # One-token continuations (the letter of an MMLU answer, a one-token choice) need the
    # prompt pass alone: no continuation pass then.
    longest = max(len(c) for c in conts)
    cont = 1 if longest == 1 else bucket(longest, MIN_CONTINUATION_BUCKET, fine=True)
    plen = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET, fine=True)
    padded = ids + [ids[0]] * (rows - len(ids))
    shared = shared_prompts(padded, layout.row_multiple) if share else None
    return ScoreShape(rows, cont, plen, 0 if shared is None else len(shared[0]))


def _result(
    out: dict[str, np.ndarray],
    i: int,
    prompt: list[int],
    cont: list[int],
    num_top: int,
    with_params: bool,
    info: ModelInfo,
) -> ScoreResult:
    n = len(cont)
    bad = np.flatnonzero(out["bad"][i, :n]).tolist()
    error = None
    if bad:
        error = (
            f"the model's logits held NaN or +inf, or -inf for every token, at continuation "
            f"position(s) {bad}: their log-probabilities are -inf"
        )
    top = None
    if num_top:
        top = [
            {
                int(t): float(v)
                for t, v in zip(out["top_ids"][i, j], out["top_values"][i, j], strict=True)
            }
            for j in range(n)
        ]
    return ScoreResult(
        token_ids=list(cont),
        prompt_token_ids=list(prompt),
        raw_logprobs=out["raw"][i, :n].tolist(),
        is_argmax=out["is_argmax"][i, :n].tolist(),
        logprobs=out["processed"][i, :n].tolist() if with_params else None,
        top_logprobs=top,
        text=None if info.tokenizer is None else info.tokenizer.decode(cont),
        error=error,
    )


# ----------------------------------------------------------------------------- device side


def continuation_logits(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    prompt_len: jax.Array,  # [B] i32
    cont: jax.Array,  # [B, C] i32, right-padded
    cont_len: jax.Array,  # [B] i32
    cache_len: int,
    layout: Layout = ONE_DEVICE,
    routing: tuple[jax.Array, jax.Array] | None = None,
    row_prompt: jax.Array | None = None,  # [B] i32: row b continues prompt row_prompt[b]
    rows: Rows | None = None,  # the rows' adapters (not with row_prompt)
) -> jax.Array:
    """[B, C, V] f32: the logits each continuation token was predicted from (module
    docstring): the prompt pass's last column, then the continuation's own columns.
    `routing` (a mixture of experts): the experts to replay, `[B, P, L, k]` for the
    prompt's columns and `[B, C, L, k]` for the continuation's (-1: the router's own).
    With `row_prompt`, `prompt` and `positions` (and the prompt's routing) hold the K
    distinct prompts ([K, P]): the prompt pass runs once per prompt, and each row gathers
    its prompt's last-column logits and cache (every cache leaf is per row, [K, ...]).
    Where `rows` captures layers (`Rows.capture`; only the static field, with
    `row_prompt`) it returns `(logits, states)`, states [B, C, len(capture), E] float32
    at the same columns as the logits."""
    width = cont.shape[1]
    prompt_routing, cont_routing = (None, None) if routing is None else routing
    first, cache, *extras = forward_prompt(
        runner, weights, prompt, positions, cache_len, layout, routing=prompt_routing, rows=rows
    )
    capturing = rows is not None and bool(rows.capture)
    states = extras[-1][:, -1:].astype(jnp.float32) if capturing else None  # [B, 1, L, E]
    if row_prompt is not None:
        first = first[row_prompt]
        states = None if states is None else states[row_prompt]
    if width == 1:
        logits = first[:, None].astype(jnp.float32)
        return (logits, states) if capturing else logits
    if row_prompt is not None:
        cache = layout.cache(jax.tree.map(lambda x: x[row_prompt], cache), cont.shape[0])
    col = jnp.arange(width - 1)[None, :]  # [1, C - 1]
    pos = jnp.where(col < cont_len[:, None] - 1, prompt_len[:, None] + col, -1)
    routed = {} if cont_routing is None else {"routing": cont_routing[:, :-1]}
    rest, _, *more = runner.forward_columns(
        weights, cont[:, :-1], pos.astype(jnp.int32), cache, rows=rows, **routed
    )
    logits = jnp.concatenate([first[:, None], rest], axis=1).astype(jnp.float32)
    if not capturing:
        return logits
    return logits, jnp.concatenate([states, more[-1].astype(jnp.float32)], axis=1)


def raw_logprobs(
    logits: jax.Array,  # [B, C, V] f32
    tokens: jax.Array,  # [B, C] i32
    valid: jax.Array,  # [B, C] bool
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """[B, C] f32: each token's float32 log-softmax under the model, -inf where not `valid`
    or the position's logits are bad (NaN or +inf, or -inf for every token), with the
    sampler's own normalizer (`raw_normalizer`, the one `generate` reports `raw_logprobs`
    with; `jax.nn.logsumexp` differs in the last bits); and that normalizer's (row max,
    log-sum, bad) [B, C] each."""
    raw_max, raw_norm, bad = raw_normalizer(logits)  # [B, C] each
    bad = bad | (raw_norm == -jnp.inf)  # every token -inf: (-inf) - (-inf) would be NaN
    norm = jnp.where(bad, 0.0, raw_norm)
    raw_tok = jnp.take_along_axis(logits, tokens[..., None], axis=2)[..., 0]
    raw = jnp.where(valid & ~bad, (raw_tok - raw_max) - norm, NEG_INF)
    return raw, (raw_max, norm, bad)


def processed_logprobs(
    logits: jax.Array,  # [B, C, V] f32
    tokens: jax.Array,  # [B, C] i32
    valid: jax.Array,  # [B, C] bool
    params: SamplingParams,
    history: History,  # the prompts, room for C more tokens
    automata: constraints.Automata | None = None,
    fsm: jax.Array | None = None,  # [B] i32, the rows' initial automaton states
    *,
    keep_mask: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """[B, C] f32: each token's log-probability under its row's final distribution, the
    continuation's earlier tokens taken as generated (a scan over the positions: the
    history, processor states and automaton states advance by each token in turn); and
    with `keep_mask` the [B, C, V] bool tokens that distribution keeps at each position
    (the filters' survivors; a greedy row's argmax alone; none where the row's logits are
    bad or every token was masked), else None."""
    batch, width, _ = logits.shape
    states = procs.init_states(params.processors, batch, logits.shape[2])
    if fsm is None:
        fsm = jnp.full((batch,), -1, jnp.int32)

    def one(carry, xs):
        history, states, fsm = carry
        z, tok, ok, j = xs  # [B, V], [B], [B], []
        positions = jnp.full((batch,), j, jnp.int32)
        bits = None if automata is None else constraints.row_bits(automata, fsm)
        proc = adjust_logits(z, params, positions, history, states=states, done=~ok,
                             allowed_bits=bits)  # fmt: skip
        key = row_keys(params.seed, positions)
        drawn, thr = xla_filter_and_sample(
            proc.adjusted, params.top_k, params.top_p, params.min_p, proc.greedy, key,
            temperature=proc.temperature,
        )  # fmt: skip
        m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)
        x_tok = jnp.take_along_axis(proc.adjusted, tok[:, None], axis=1)
        x_tok = scale_logits(x_tok, proc.temperature)[:, 0]
        kept = x_tok >= thr.kept
        other = (x_tok - m) - (drawn.log_norm - m)
        lp = jnp.where(tok == drawn.tokens, drawn.logprobs, jnp.where(kept, other, NEG_INF))
        greedy_lp = jnp.where(tok == drawn.tokens, 0.0, NEG_INF)
        lp = jnp.where(proc.greedy, greedy_lp, lp)
        ok_row = proc.status(thr.row_max) == STATUS_OK
        lp = jnp.where(ok_row, lp, NEG_INF)
        keep = None
        if keep_mask:
            scaled = scale_logits(proc.adjusted, proc.temperature)  # [B, V]
            kept_all = scaled >= thr.kept[:, None]
            argmax = jax.nn.one_hot(drawn.tokens, scaled.shape[1], dtype=jnp.bool_)
            keep = jnp.where(proc.greedy[:, None], argmax, kept_all) & ok_row[:, None]
        if params.processors:
            step = procs.Step(positions=positions, history=history, done=~ok)
            new = procs.update_all(params.processors, states, tok, step)
            states = jax.tree.map(
                lambda a, b: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, states
            )
        if automata is not None:
            fsm = constraints.advance(automata, fsm, bits, tok, ok)
        return (history.append(tok, where=ok), states, fsm), (lp, keep)

    xs = (
        jnp.moveaxis(logits, 1, 0),
        tokens.T,
        valid.T,
        jnp.arange(width, dtype=jnp.int32),
    )
    _, (lp, keep) = jax.lax.scan(one, (history, states, fsm), xs)
    return lp.T, None if keep is None else jnp.moveaxis(keep, 0, 1)


@functools.partial(runner_jit, static_argnames=("runner", "num_top", "layout"))
def score_batch(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    prompt_len: jax.Array,  # [B] i32
    history: History,  # [B, P + N], N >= C
    cont: jax.Array,  # [B, C] i32, right-padded with 0
    cont_len: jax.Array,  # [B] i32
    params: SamplingParams | None,
    automata: constraints.Automata | None,
    fsm: jax.Array | None,  # [B] i32
    row_prompt: jax.Array | None = None,  # [B] i32; then prompt, positions are [K, P]
    rows: Rows | None = None,  # the rows' adapters (`ll.Rows`), not with row_prompt
    *,
    num_top: int,
    layout: Layout = ONE_DEVICE,
) -> dict[str, jax.Array]:
    """One batch's scores: raw [B, C], is_argmax [B, C], processed [B, C] (with params),
    top_ids / top_values [B, C, num_top]. With `row_prompt` the prompt pass runs over the
    batch's distinct prompts (`continuation_logits`)."""
    batch, width = cont.shape
    prompt, positions = layout.rows((prompt, positions), prompt.shape[0])
    prompt_len, history, cont, cont_len, params, fsm, row_prompt = layout.rows(
        (prompt_len, history, cont, cont_len, params, fsm, row_prompt), batch
    )
    logits = continuation_logits(
        runner, weights, prompt, positions, prompt_len, cont, cont_len,
        history.tokens.shape[1], layout, row_prompt=row_prompt, rows=rows,
    )  # fmt: skip
    states = None
    if rows is not None and rows.capture:
        logits, states = logits
    valid = jnp.arange(width)[None, :] < cont_len[:, None]  # [B, C]
    raw, (raw_max, norm, bad) = raw_logprobs(logits, cont, valid)
    best = first_argmax(logits.reshape(batch * width, -1)).reshape(batch, width)
    out = dict(raw=raw, is_argmax=valid & ~bad & (best == cont), bad=valid & bad)
    if states is not None:
        out["captured"] = states
    if params is not None:
        lp, _ = processed_logprobs(logits, cont, valid, params, history, automata, fsm)
        out["processed"] = jnp.where(valid, lp, NEG_INF)
    if num_top:
        log_sm = (logits - raw_max[..., None]) - norm[..., None]
        log_sm = jnp.where(bad[..., None], NEG_INF, log_sm)  # no alternatives from bad logits
        vals, ids = jax.lax.top_k(log_sm, min(num_top, logits.shape[2]))
        out["top_ids"], out["top_values"] = ids.astype(jnp.int32), vals
    return out
