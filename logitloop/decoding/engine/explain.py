"""`explain`: what every sampling knob does to the next token, from the sampler's own code.

    expl = explain_next_token(model, "Once upon a time", params)   # params: batch of 1
    draws = draw_next_tokens(expl, 2000)       # ll.sample, batched over seeds
    sweep = temperature_sweep(expl, [0.5, 1.0, 2.0])

The terminal table and the figure that show an `Explanation` are the CLI's
(`logitloop.cli.explain_view`: `format_table`, `explanation_figure`).

`explain_next_token` runs the model's prefill for the prompt exactly as `generate` does
(same left padding, prompt bucket and cache length, same `prepare`, so the model's EOS ids
join the stop token ids unless `ignore_eos`; under `adapter=` of `adapters=`, the row's
LoRA adapter, with `generate`'s `Plan.adapter_rows`), then the sampler's own pieces for generated
index 0 with the prompt as history:

- `raw`: softmax of the model's logits;
- `adjusted`: softmax after masks, bias, `min_tokens` and penalties (`adjust_logits` steps
  1-3, `Processed.adjusted`);
- `tempered`: softmax after temperature (`Processed.scaled`); one-hot at the argmax for
  temperature 0 (greedy), and the logits divided by T for `top_k == 1` rows (which the
  sampler leaves unscaled because the argmax is all it needs);
- `after_top_k`, `after_top_p`, `final`: the scaled logits renormalised over the tokens at
  or above `max` of the thresholds so far (`ops.sampling.xla.thresholds`, combined by
  `sampler.kept_distribution`). `final` is checked against `ll.sampling_distribution`.

Each token's `cut` says which step removed it (`STEP_NAMES`): a token survives a step iff
its scaled logit is at least that step's threshold, cumulatively. The scaled logits keep
their order under temperature, so the kept set is always the top of `token_ids`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine.host import MIN_BUFFER_BUCKET, prompt_batch
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.loop import repetition
from logitloop.decoding.loop.decode_loop import forward_prompt
from logitloop.decoding.loop.runner import ModelRunner
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling import transforms
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.decoding.sampling.sampler import (
    STATUS_BAD_LOGITS,
    STATUS_OK,
    adjust_logits,
    kept_distribution,
    sample,
    sampling_distribution,
)
from logitloop.ops.sampling.xla import NUM_CANDIDATES, Thresholds, thresholds

# Which step cut a token (`Explanation.cut`).
KEPT = 0
CUT_MASK = 1  # allowed/banned ids, min_tokens (bias and penalties never reach -inf)
CUT_GREEDY = 2  # temperature 0: everything but the argmax
CUT_TOP_K = 3
CUT_TOP_P = 4
CUT_MIN_P = 5
CUT_INVALID = 6  # the logits hold NaN or +inf (STATUS_BAD_LOGITS)
CUT_PROCESSOR = 7  # a user processor set it to -inf
STEP_NAMES = {
    KEPT: "kept",
    CUT_MASK: "masks",
    CUT_GREEDY: "temperature 0",
    CUT_TOP_K: "top-k",
    CUT_TOP_P: "top-p",
    CUT_MIN_P: "min-p",
    CUT_INVALID: "bad logits",
    CUT_PROCESSOR: "processors",
}
# The per-step distributions, in pipeline order: (attribute, column title). With user
# processors, ("processed", "processors") follows "adjusted" (`Explanation.stages`).
STAGES = (
    ("raw", "raw"),
    ("adjusted", "masks/bias/pen"),
    ("tempered", "temperature"),
    ("after_top_k", "top-k"),
    ("after_top_p", "top-p"),
    ("final", "min-p=final"),
)
# `final` must equal `sampling_distribution` to this absolute tolerance.
FINAL_ATOL = 1e-6


@dataclasses.dataclass(frozen=True, eq=False)
class Explanation:
    """The next-token pipeline for one prompt, every array over the whole vocabulary [V]."""

    prompt_token_ids: list[int]
    token_ids: np.ndarray  # [V] i64: every id, most likely first (scaled, then raw logit)
    logits: np.ndarray  # [V] f32, the model's logits for the next token
    raw: np.ndarray  # [V] f32 probabilities, per stage (see STAGES)
    adjusted: np.ndarray
    tempered: np.ndarray
    after_top_k: np.ndarray
    after_top_p: np.ndarray
    final: np.ndarray  # == ll.sampling_distribution(...)[0]
    cut: np.ndarray  # [V] i8: KEPT or the CUT_* step that removed the token
    thresholds: dict[str, float]  # row_max, top_k, top_p, min_p, kept (scaled-logit space)
    greedy: bool
    status: int
    sampled_token: int  # what ll.sample draws with the row's own seed
    sampled_logprob: float
    params: SamplingParams  # batch of 1, as the sampler saw it (EOS in the stop ids)
    history: History  # batch of 1: the prompt
    tokenizer: Any = None
    # The row's repetition guard on the prompt and the sampled token read as generated text
    # (`repetition_cut`): (n, p), cut after its n-th token on a period of p tokens; None
    # when it would not be cut, or the row has no guard.
    repetition_cut: tuple[int, int] | None = None
    # After steps 1-3 and the user's processors (None without processors); processors that
    # run after temperature show in `tempered`.
    processed: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[0])

    @property
    def seed(self) -> int:
        return int(np.asarray(self.params.seed)[0])

    def knob(self, name: str) -> float:
        """The row's value of a scalar knob (`temperature`, `top_k`, ...)."""
        return np.asarray(getattr(self.params, name))[0].item()

    def stages(self) -> list[tuple[str, np.ndarray]]:
        """(column title, probabilities [V]) per step, in pipeline order."""
        stages = [(title, getattr(self, attr)) for attr, title in STAGES]
        if self.processed is not None:
            stages.insert(2, ("processors", self.processed))
        return stages

    def candidates(self, n: int) -> np.ndarray:
        """The `n` most likely ids after masks, bias and penalties, followed by any of the
        model's own `n` most likely that those steps pushed out (in the same order)."""
        top = self.token_ids[:n]
        raw_top = np.argsort(-self.logits, kind="stable")[:n]
        extra = set(raw_top.tolist()) - set(top.tolist())
        if not extra:
            return top
        rank = np.empty_like(self.token_ids)
        rank[self.token_ids] = np.arange(self.vocab_size)
        return np.concatenate([top, np.asarray(sorted(extra, key=lambda t: rank[t]))])

    def token_text(self, token_id: int) -> str:
        """The token's text, repr-escaped (`' the'`, `'\\n'`, `b'\\xe2'` for part of a
        character); `#id` without a tokenizer."""
        token_id = int(token_id)
        if self.tokenizer is None:
            return f"#{token_id}"
        data = self.tokenizer.token_bytes(token_id)
        if not data:  # special tokens and ids the tokenizer does not know
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return repr(text) if text else f"#{token_id}"
        try:
            return repr(data.decode("utf-8"))
        except UnicodeDecodeError:
            return repr(data)


@functools.partial(jax.jit, static_argnames=("runner", "cache_len"))
def _prefill_logits(runner: ModelRunner, weights, prompt, positions, rows, *, cache_len: int):
    """The next-token logits [B, V] of left-padded prompts, as `loop.prefill` gets them
    (`rows`: the rows' `ll.Rows`, their adapters; None for the base)."""
    return forward_prompt(runner, weights, prompt, positions, cache_len, rows=rows)[0]


def _no_cut(thr: Thresholds, z: jax.Array) -> Thresholds:
    """Thresholds that keep every token of `z`, for `kept_distribution` = softmax(z)."""
    off = jnp.full_like(thr.row_max, -jnp.inf)
    return Thresholds(row_max=jnp.max(z, axis=1), top_k=off, top_p=off, min_p=off)


def _pipeline(logits, params: SamplingParams, positions, history: History) -> dict[str, Any]:
    """Every step's distribution and the cutting step, from the sampler's own functions."""
    states = procs.init_states(params.processors, *logits.shape)
    proc = adjust_logits(logits, params, positions, history, states=states)
    x = proc.scaled
    vocab = x.shape[1]
    cand_x, _ = jax.lax.top_k(x, min(NUM_CANDIDATES, vocab))
    thr = thresholds(x, *proc.rules(params.knobs), cand_x)
    status = proc.status(thr.row_max)
    off = jnp.full_like(thr.row_max, -jnp.inf)
    no_greedy = jnp.zeros_like(proc.greedy)
    t_zero = params.temperature == 0
    one_hot = jax.nn.one_hot(jnp.argmax(x, axis=1), vocab, dtype=jnp.float32)

    # Greedy rows: temperature 0 keeps only the argmax at the temperature step; top_k == 1
    # rows are unscaled in `scaled`, so show them divided by T (as any other row).
    tempered_x = transforms.apply_temperature(proc.adjusted, params.temperature)
    if any(procs.place(p) != "early" for p in params.processors):
        tempered_x = proc.adjusted  # scaled already, the late processors applied
    tempered_x = jnp.where(jnp.isnan(tempered_x), -jnp.inf, tempered_x)
    tempered_x = jnp.where(proc.greedy[:, None], tempered_x, x)
    tempered = kept_distribution(tempered_x, _no_cut(thr, tempered_x), t_zero)
    after_k = kept_distribution(x, thr.replace(top_p=off, min_p=off), no_greedy)
    after_p = kept_distribution(x, thr.replace(min_p=off), no_greedy)
    after_k = jnp.where(proc.greedy[:, None], one_hot, after_k)
    after_p = jnp.where(proc.greedy[:, None], one_hot, after_p)
    final = kept_distribution(x, thr, proc.greedy)

    raw_x = jnp.where(jnp.isnan(proc.raw), -jnp.inf, proc.raw)
    pen_x = jnp.where(jnp.isnan(proc.penalized), -jnp.inf, proc.penalized)
    adj_x = jnp.where(jnp.isnan(proc.adjusted), -jnp.inf, proc.adjusted)
    raw = jnp.nan_to_num(kept_distribution(raw_x, _no_cut(thr, raw_x), no_greedy))
    adjusted = kept_distribution(pen_x, _no_cut(thr, pen_x), no_greedy)
    processed = kept_distribution(adj_x, _no_cut(thr, adj_x), no_greedy)

    t_k = thr.top_k[:, None]
    t_kp = jnp.maximum(thr.top_k, thr.top_p)[:, None]
    cut = jnp.where(
        x < t_k,
        CUT_TOP_K,
        jnp.where(x < t_kp, CUT_TOP_P, jnp.where(x < thr.kept[:, None], CUT_MIN_P, KEPT)),
    )
    not_argmax = one_hot == 0
    cut = jnp.where(
        proc.greedy[:, None] & not_argmax, jnp.where(t_zero[:, None], CUT_GREEDY, CUT_TOP_K), cut
    )
    cut = jnp.where(adj_x == -jnp.inf, CUT_PROCESSOR, cut)
    cut = jnp.where(pen_x == -jnp.inf, CUT_MASK, cut)
    cut = jnp.where((status == STATUS_BAD_LOGITS)[:, None], CUT_INVALID, cut)
    cut = cut.astype(jnp.int8)
    ok = (status == STATUS_OK)[:, None]

    def only_ok(p):
        return jnp.where(ok, p, 0.0)

    return dict(
        raw=raw,
        adjusted=only_ok(adjusted),
        processed=only_ok(processed),
        tempered=only_ok(tempered),
        after_top_k=only_ok(after_k),
        after_top_p=only_ok(after_p),
        final=only_ok(final),
        cut=cut,
        scaled=x,
        thresholds=dict(
            row_max=thr.row_max, top_k=thr.top_k, top_p=thr.top_p, min_p=thr.min_p, kept=thr.kept
        ),
        greedy=proc.greedy,
        status=status,
    )


@jax.jit
def _explain_step(logits, params: SamplingParams, positions, history: History):
    """The pipeline, `ll.sampling_distribution` and `ll.sample` in one compiled program."""
    out = _pipeline(logits, params, positions, history)
    reference = sampling_distribution(logits, params, positions, history)
    return out, reference, sample(logits, params, positions, history)


@jax.jit
def _sweep_step(logits, params: SamplingParams, plain: SamplingParams, positions, history):
    """Temperature alone (`plain`: top-k off) and `ll.sampling_distribution` (every knob)."""
    tempered = _pipeline(logits, plain, positions, history)["tempered"]
    return tempered, sampling_distribution(logits, params, positions, history)


def explain_next_token(
    model: Any,
    prompt: str | Sequence[int],
    params: SamplingParams,
    *,
    ignore_eos: bool = False,
    processors: Sequence[Any] | None = None,
    adapters: Any = None,
    adapter: str | None = None,
) -> Explanation:
    """Run the prompt's prefill and the sampler's steps for the next token (see the module
    docstring). `params` must hold one row; its `max_tokens` is not used (the prompt needs
    room for one more token only). `processors` (one row each) add a "processors" stage.
    `adapters`, `adapter`: LoRA adapters (`ll.load_adapter`) and the row's adapter by
    name (None: the base model), as in `generate`."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
    if params.batch_size != 1:
        raise ValueError(f"params has batch_size {params.batch_size}; explain takes one row")
    if params.constraints:  # its stages have no constraint mask: refused, not ignored
        raise ValueError("explain does not support json_schema, regex or choice constraints")
    params = params.replace(max_tokens=jnp.ones_like(params.max_tokens))
    options = Options(
        ignore_eos=ignore_eos, processors=processors, adapters=adapters, adapter=adapter
    )
    job = plan(model, options, adapters=True)
    info = job.info
    ids, params = job.rows([prompt], params)
    ids0 = ids[0]
    params = params.device_only()
    rows = job.layout.place_rows(job.adapter_rows(1, 1))  # as `Plan.tables` places them

    # The prefill layout of host.initial_state for a one-token buffer.
    batch = prompt_batch([ids0], MIN_BUFFER_BUCKET)
    history = jax.tree.map(jnp.asarray, batch.history)
    logits = _prefill_logits(
        info.runner, info.weights, batch.prompt, batch.positions, rows,
        cache_len=batch.cache_len,
    )  # fmt: skip
    logits = logits.astype(jnp.float32)
    step = jnp.zeros((1,), jnp.int32)  # generated index 0

    out, reference, drawn = jax.device_get(_explain_step(logits, params, step, history))
    reference = reference[0]
    if not np.allclose(out["final"][0], reference, rtol=0.0, atol=FINAL_ATOL):
        worst = float(np.max(np.abs(out["final"][0] - reference)))
        raise RuntimeError(
            f"internal error: explain's final distribution differs from "
            f"ll.sampling_distribution by {worst:g}"
        )

    row_logits = np.asarray(logits[0])
    scaled = out["scaled"][0]
    # Most likely first: scaled logit (the sampler's own order), then the raw logit, then id.
    token_ids = np.lexsort((np.arange(row_logits.shape[0]), -row_logits, -scaled))
    return Explanation(
        prompt_token_ids=list(ids0),
        token_ids=token_ids,
        logits=row_logits,
        raw=out["raw"][0],
        adjusted=out["adjusted"][0],
        tempered=out["tempered"][0],
        after_top_k=out["after_top_k"][0],
        after_top_p=out["after_top_p"][0],
        final=out["final"][0],
        cut=out["cut"][0],
        thresholds={k: float(v[0]) for k, v in out["thresholds"].items()},
        greedy=bool(out["greedy"][0]),
        status=int(out["status"][0]),
        sampled_token=int(drawn.tokens[0]),
        sampled_logprob=float(drawn.logprobs[0]),
        params=params,
        history=history,
        tokenizer=info.tokenizer,
        processed=out["processed"][0] if params.processors else None,
        repetition_cut=repetition_cut([*ids0, int(drawn.tokens[0])], params),
    )


def repetition_cut(tokens: Sequence[int], params: SamplingParams) -> tuple[int, int] | None:
    """Where row 0's `repetition_guard` would have cut a row that generated `tokens`: (n, p),
    after its n-th token on a period of p tokens (the loop's own check after each token,
    `repetition.periods_after_each`), or None (no cut, or no guard)."""
    period, repeats = (int(np.asarray(x)[0]) for x in (params.guard_period, params.guard_repeats))
    if period == 0 or not tokens:
        return None
    one = np.ones((1,), np.int32)
    hits = np.asarray(
        repetition.periods_after_each(
            jnp.asarray([list(tokens)], jnp.int32), period * one, repeats * one
        )
    )[:, 0]
    first = np.flatnonzero(hits)
    return None if not first.size else (int(first[0]) + 1, int(hits[first[0]]))


def _repeat(tree: Any, rows: int) -> Any:
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (rows, *a.shape[1:])), tree)


def draw_next_tokens(
    expl: Explanation, num_draws: int, *, first_seed: int | None = None, chunk: int | None = None
) -> np.ndarray:
    """[num_draws] tokens from `ll.sample` on the explained logits, batched over the seeds
    first_seed, first_seed + 1, ... (mod 2**32; default: the row's own seed, so draw 0 is
    the token `generate` picks first)."""
    if isinstance(num_draws, bool) or not isinstance(num_draws, (int, np.integer)):
        raise ValueError(f"num_draws must be an integer, got {num_draws!r}")
    if num_draws < 1:
        raise ValueError(f"num_draws = {num_draws} is outside the allowed range [1, inf)")
    vocab = expl.vocab_size
    if chunk is None:
        chunk = max(1, min(num_draws, (1 << 24) // vocab))  # at most 16M logits per call
    base = expl.seed if first_seed is None else int(first_seed)
    logits = _repeat(jnp.asarray(expl.logits)[None, :], chunk)
    params = _repeat(expl.params, chunk)
    history = _repeat(expl.history, chunk)
    positions = jnp.zeros((chunk,), jnp.int32)
    out = []
    for start in range(0, num_draws, chunk):  # a fixed chunk shape: compiles once
        seeds = (base + start + np.arange(chunk, dtype=np.int64)) % (1 << 32)
        p = params.replace(seed=jnp.asarray(seeds.astype(np.uint32)))
        out.append(np.asarray(sample(logits, p, positions, history).tokens))
    return np.concatenate(out)[:num_draws].astype(np.int64)


def temperature_sweep(expl: Explanation, temperatures: Sequence[float]) -> dict[str, np.ndarray]:
    """Probabilities [len(temperatures), V] as the temperature varies, the other knobs
    fixed: `tempered` (temperature alone, after masks/bias/penalties; top-k off so that
    top_k == 1 does not make the row greedy) and `final` (`ll.sampling_distribution` with
    every knob). Temperatures must be > 0."""
    temps = np.asarray(temperatures, np.float32)
    if temps.ndim != 1 or not temps.size or not np.all(temps > 0):
        raise ValueError("temperatures must be a non-empty list of values > 0")
    rows = temps.shape[0]
    logits = _repeat(jnp.asarray(expl.logits)[None, :], rows)
    params = _repeat(expl.params, rows).replace(temperature=jnp.asarray(temps))
    history = _repeat(expl.history, rows)
    positions = jnp.zeros((rows,), jnp.int32)
    plain = params.replace(top_k=jnp.zeros_like(params.top_k))
    tempered, final = jax.device_get(_sweep_step(logits, params, plain, positions, history))
    return {"temperature": temps, "tempered": tempered, "final": final}
