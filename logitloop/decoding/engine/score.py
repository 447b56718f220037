"""`score`: the log-probability of given continuations, one forward pass per batch.

For every pair (prompt, continuation) and every continuation token, `score` reports its
log-probability under the model (`raw_logprobs`: the float32 log-softmax of the logits,
as `generate` reports `raw_logprobs`) and, with `params`, under the row's processed
distribution at that position (`logprobs`: the sampler's own steps 1-7, `sampler.
adjust_logits` and the truncation thresholds, with the history as it is at that
position; -inf where a mask or filter removes the token), the top-n raw alternatives,
and whether each token was the model's argmax.

The pairs run in packed passes (`packed`: many pairs' tokens as one stream, each seeing
its own), on a mesh in row batches (`score_rows`). The tokens go through the model as
`generate`'s do: prompt tokens as a prompt pass's, continuation tokens as generated ones
(a decode step's, a speculative verification's), so with `deterministic=True` every
logit, and so every log-probability, is bit for bit the one `generate` computed for the
tokens it drew. The LM head runs on the scored positions only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import inside, packed, reuse
from logitloop.decoding.engine.host import (
    MIN_PROMPT_BUCKET,
    bucket,
    check_count,
    check_prompt,
    constraint_tables,
    prompt_batch,
    tokenize_prompt,
)
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.engine.score_rows import score_row_batch, score_rows
from logitloop.decoding.engine.token_scores import NEG_INF, processed_logprobs, token_scores
from logitloop.decoding.loop.runner import ModelInfo, ModelRunner, runner_jit
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from logitloop.models.kv import Packed, Rows
from logitloop.models.steering import Steering


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
    token_budget: int = packed.TOKEN_BUDGET,
    steer: Any = None,
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

    The pairs run longest first in packed passes (`packed`: the tokens of many pairs as one
    stream, each pair seeing only its own): a pass holds at most `token_budget` tokens
    and `batch_size` pairs, and its program depends on its token buckets only
    (docs/scoring.md, "What compiles"), so few programs compile, a pass that an earlier
    program covers compiles none (`reuse`), and `progress(done, total)` is called after
    each pass. A pair longer than `token_budget` runs in a pass of its own. Pairs whose
    prompts are the same ids share the prompt's tokens in a pass; with
    `share_prompts=False` every pair feeds its own (the values are the same, with
    `deterministic=True` bit for bit). With `mesh` the pairs run in batches of
    `batch_size` rows instead, bucketed by rows, prompt and continuation widths
    (`score_rows`, `shared_prompts`). `mesh`, `deterministic`: as in `generate`; with
    `deterministic=True` the values are bit for bit those `generate` reports for the same
    tokens. `adapters`, `adapter`: LoRA adapters (`ll.load_adapter`) and each pair's
    adapter by name, one for all or one per pair (None: the base), as in `generate`;
    pairs under adapters run their own prompt passes (no sharing yet). `capture`: an
    `ll.Capture` (not with `mesh`): each result's `captured`, `[len(continuation), C, E]`
    float32, the residual stream at the captured layers at the token each continuation
    token was predicted from (the prompt's last, then the continuation's own; as
    `generate`'s without `prompt=True`, which `score` refuses; docs/inside.md).
    `steer`: steering vectors (`ll.Steer`, one for every pair or one entry per pair, as in
    `generate`; not with `mesh`): "prompt" steers the prompt's tokens, "generated" the
    continuation's, so a pair scores what `generate` computed for the same tokens under
    the same steering; steered pairs run their own prompt passes.
    """
    check_count("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    options = Options(mesh=mesh, deterministic=deterministic, adapters=adapters, adapter=adapter)
    job = plan(model, options, adapters=True)
    adapters = job.options.adapters  # the table where the layout reads it
    layers = score_capture(capture, job)
    info, layout = job.info, job.layout
    check_count("batch_size", batch_size, 1)
    check_count("token_budget", token_budget, 1)
    batch_size = -(-batch_size // layout.row_multiple) * layout.row_multiple
    ids, conts = score_pairs(prompts, continuations, info)
    total = len(ids)
    slots = None if adapters is None else adapters.slots(adapter, total)
    steers = score_steering(steer, ids, job)
    share_prompts = share_prompts and slots is None and steers is None
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
    if mesh is None and info.runner.kv_spec is not None:
        steered = None if steers is None else steers[0].shape[1:]  # K, E
        key = ("packed score", info.runner, top_logprobs, params is not None,
               slots is not None, layers, steered)  # fmt: skip
        passes = packed.split_passes(
            ids, conts, order, token_budget, batch_size, slots, share_prompts
        )
        done = 0
        for rows in passes:
            out = _score_packed(
                info, [ids[r] for r in rows], [conts[r] for r in rows],
                None if params is None else params.take(rows), top_logprobs, key,
                share_prompts, None if slots is None else (adapters, slots[rows]), layers,
                None if steers is None else tuple(a[rows] for a in steers),
            )  # fmt: skip
            for i, r in enumerate(rows):
                results[r] = _result(out[i], ids[r], conts[r], top_logprobs, info)
            done += len(rows)
            if progress is not None:
                progress(done, total)
        return results
    # The programs' key besides the buckets (`reuse`): a call reuses the buckets of an
    # earlier one that cover its own.
    key = ("score", info.runner, layout, top_logprobs, params is not None, slots is not None,
           layers)  # fmt: skip
    for start in range(0, total, batch_size):
        rows = order[start : start + batch_size]
        width = batch_size if total > batch_size else score_rows(len(rows), batch_size, layout)
        out = score_row_batch(
            info, [ids[r] for r in rows], [conts[r] for r in rows],
            None if params is None else params.take(rows), top_logprobs, layout,
            share_prompts, rows=width, key=key,
            adapters=None if slots is None else (adapters, slots[rows]), capture=layers,
        )  # fmt: skip
        for i, r in enumerate(rows):
            values = {name: v[i, : len(conts[r])] for name, v in out.items()}
            results[r] = _result(values, ids[r], conts[r], top_logprobs, info)
        if progress is not None:
            progress(min(start + batch_size, total), total)
    return results


def score_steering(steer: Any, ids: list[list[int]], job: Any) -> tuple[np.ndarray, ...] | None:
    """The pairs' steering as host arrays (`inside.steering_arrays`, one row per pair), or
    None without it; refused by name with `mesh` (the row batches take none yet)."""
    if steer is None:
        return None
    if job.options.mesh is not None:
        raise NotImplementedError("score(steer=) runs on one device: not with mesh= yet")
    return inside.steering_arrays(steer, ids, 1, len(ids), job.num_layers, job.info.residual_width)


def score_capture(capture: Any, job: Any) -> tuple[int, ...]:
    """The layers `score(capture=)` records (`ll.residual`'s numbers), () without it;
    checked by name before anything runs."""
    if capture is None:
        return ()
    if not isinstance(capture, inside.Capture):
        raise ValueError(f"capture must be an ll.Capture(layers=...), got {type(capture).__name__}")
    if capture.prompt or job.options.mesh is not None:
        raise NotImplementedError(
            "score(capture=) records the continuation's positions only, on one device: "
            "Capture(prompt=True) and mesh= are not done yet (docs/inside.md)"
        )
    return capture.model_layers(job.num_layers)


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


def _result(
    values: dict[str, np.ndarray],
    prompt: list[int],
    cont: list[int],
    num_top: int,
    info: ModelInfo,
) -> ScoreResult:
    """One pair's `ScoreResult` from its values, one entry per continuation token
    (`raw`, `is_argmax`, `bad`; `processed` with params, `top_ids` / `top_values` with
    `num_top`, `captured` with capture)."""
    bad = np.flatnonzero(values["bad"]).tolist()
    error = None
    if bad:
        error = (
            f"the model's logits held NaN or +inf, or -inf for every token, at continuation "
            f"position(s) {bad}: their log-probabilities are -inf"
        )
    top = None
    if num_top:
        top = [
            {int(t): float(v) for t, v in zip(ids, vals, strict=True)}
            for ids, vals in zip(values["top_ids"], values["top_values"], strict=True)
        ]
    processed = values.get("processed")
    captured = values.get("captured")
    return ScoreResult(
        token_ids=list(cont),
        prompt_token_ids=list(prompt),
        raw_logprobs=values["raw"].tolist(),
        is_argmax=values["is_argmax"].tolist(),
        logprobs=None if processed is None else processed.tolist(),
        top_logprobs=top,
        text=None if info.tokenizer is None else info.tokenizer.decode(cont),
        error=error,
        captured=None if captured is None else np.asarray(captured),
    )


def _score_packed(
    info: ModelInfo,
    ids: list[list[int]],
    conts: list[list[int]],
    params: SamplingParams | None,
    num_top: int,
    key: Any,
    share: bool,
    adapters: tuple[Any, np.ndarray] | None,
    capture: tuple[int, ...],
    steers: tuple[np.ndarray, ...] | None = None,
) -> list[dict[str, np.ndarray]]:
    """One packed pass (`packed`) on device: each pair's values, one entry per
    continuation token (`_result`). `key`: the programs' key in `reuse`; `adapters`: the
    `ll.Adapters` and each pair's slot; `capture`: the layers to record; `steers`: the
    pairs' steering (`score_steering`'s rows)."""
    slots = None if adapters is None else adapters[1]
    lay_out = functools.partial(
        packed.pack, ids, conts, share=share, slots=slots, with_params=params is not None
    )
    batch = lay_out()
    shape = reuse.fit(key, batch.shape)
    reuse.ran(key, shape)
    if shape != batch.shape:
        batch = lay_out(shape=shape)
    rows = None
    if adapters is not None:
        rows = Rows(batch.adapter, adapters[0].table)
    if capture:
        rows = (rows or Rows()).replace(capture=capture)
    if steers is not None:
        arrays = inside.steer_arrays(shape.rows, *steers[0].shape[1:])
        for padded, given in zip(arrays, steers, strict=True):
            padded[: len(ids)] = given
        rows = (rows or Rows()).replace(steer=Steering(*map(jax.device_put, arrays)))
    extra = None
    if params is not None:
        extra = _packed_params(info, ids, conts, params, batch, shape)
    layout = Packed(batch.queries, batch.keys, batch.rows)  # NumPy: staged with the call
    out = packed_score(
        info.runner, info.weights, batch.tokens, batch.positions, layout, batch.read,
        batch.targets, batch.valid, rows, extra, num_top=num_top,
        prompt_rows=shape.prompt_tokens,
    )  # fmt: skip
    out = jax.device_get(out)
    processed = out.pop("processed", None)
    values = []
    for i, (start, cont) in enumerate(zip(batch.starts, conts, strict=True)):
        pair = {name: v[start : start + len(cont)] for name, v in out.items()}
        if processed is not None:
            pair["processed"] = processed[i, : len(cont)]
        values.append(pair)
    return values


def _packed_params(info, ids, conts, params, batch, shape) -> dict[str, Any]:
    """What a packed pass with `params` needs on device: the pairs' continuations laid out
    `[rows, width]` (padded with the first pair) and where each token's logits are among
    the pass's reads, the histories (the prompts with room for the continuation), the
    constraint automata and the device-side params."""
    pad = shape.rows - len(ids)
    params = params.take(list(range(len(ids))) + [0] * pad)
    ids, conts = ids + [ids[0]] * pad, conts + [conts[0]] * pad
    starts = batch.starts + [batch.starts[0]] * pad
    cont = np.zeros((shape.rows, shape.width), np.int32)
    index = np.zeros((shape.rows, shape.width), np.int32)
    for r, (c, start) in enumerate(zip(conts, starts, strict=True)):
        cont[r, : len(c)] = c
        index[r, : len(c)] = start + np.arange(len(c))
    lengths = np.asarray([len(c) for c in conts], np.int32)
    history = prompt_batch(ids, bucket(shape.width, MIN_PROMPT_BUCKET), shape.history).history
    automata, fsm = constraint_tables(info, params)
    return dict(
        params=params.device_only(), history=history, automata=automata, fsm=fsm,
        index=index, cont=cont, cont_len=lengths,
    )  # fmt: skip


# ----------------------------------------------------------------------------- device side


@functools.partial(runner_jit, static_argnames=("runner", "num_top", "prompt_rows"))
def packed_score(
    runner: ModelRunner,
    weights: Any,
    tokens: jax.Array,  # [1, N] i32
    positions: jax.Array,  # [1, N] i32
    layout: Packed,  # [R, W] each
    read: jax.Array,  # [M] i32
    targets: jax.Array,  # [M] i32
    valid: jax.Array,  # [M] bool
    rows: Rows | None,
    extra: dict[str, Any] | None,  # `_packed_params`, with params
    *,
    num_top: int,
    prompt_rows: int,
) -> dict[str, jax.Array]:
    """One packed pass's scores (`packed`): raw, is_argmax, bad [M] and top_ids /
    top_values [M, num_top] per read column (`token_scores`), captured [M, C, E] where
    `rows` captures, and with `extra` (params) processed [rows, width]."""
    logits, *captured = packed.forward(
        runner, weights, tokens, positions, layout, read, rows, prompt_rows=prompt_rows
    )
    out = token_scores(logits[None], targets[None], valid[None], num_top)
    out = {name: v[0] for name, v in out.items()}
    if captured:
        out["captured"] = captured[0]
    if extra is not None:
        cont, lengths = extra["cont"], extra["cont_len"]
        ok = jnp.arange(cont.shape[1])[None, :] < lengths[:, None]
        lp, _ = processed_logprobs(
            logits[extra["index"]], cont, ok, extra["params"], extra["history"],
            extra["automata"], extra["fsm"],
        )  # fmt: skip
        out["processed"] = jnp.where(ok, lp, NEG_INF)
    return out
