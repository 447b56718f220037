"""`beam_search`: transformers' `generate(num_beams=..., do_sample=False)` as one compiled
`lax.while_loop`.

Beams are rows: n prompts with K beams each run as n * K rows of the model, and after
every step each row is replaced by the beam it continues (its parent): the KV cache, the
history and the processors' states are gathered by parent, so a row's cache always holds
its own beam's tokens. Finished hypotheses live in a fixed-size pool of K per prompt.

The rule (transformers 4.5x `_beam_search`, after its 2025 rewrite), per step, for each
prompt:

1. scores = log_softmax(logits), then the processors: logitloop's steps 1-3 of the
   sampling order (masks, bias, `min_tokens`, penalties) and user processors, applied to
   the log-probabilities as transformers applies its logits processors (no
   renormalisation; no temperature or truncation: the search is deterministic).
2. Every beam's running sum plus its scores: K * V candidates; keep the top
   `max(2, 1 + n_stop) * K` (n_stop: the stop token ids, EOS included), so that at least
   K of them do not end even if the best K all pick a stop token.
3. A candidate ends when its token is a stop id, when its tokens end with a stop sequence
   or its text with a stop string (below), or when it reaches `max_tokens`. Among the
   first K candidates (by rank), those that end go to the pool with the score
   `sum_logprobs / num_generated ** length_penalty`, where `num_generated` counts the
   generated tokens including the stop token (transformers' `cur_len + 1 - prompt_len`);
   the pool keeps the best K.
4. The best K candidates that do not end become the running beams.
5. The prompt stops taking hypotheses when (early_stopping=True) its pool is full, or
   (False, "never") no running beam can beat its worst pooled hypothesis: the best running
   sum divided by `num_generated ** length_penalty`, where "never" with a positive
   penalty uses `max_tokens` as the length (the best a beam could reach) and False the
   current length (a heuristic, as in transformers). The search ends when no prompt can
   improve, when every pool is full with early_stopping=True, or when every candidate of
   the step ended.

Stop sequences and stop strings are matched by the decode loop's own checks
(`decode_loop.sequence_hits` on a per-row window of the last L tokens,
`stop_strings.advance` on a per-row window of the last W bytes of text): each of the C
candidates is checked on its parent beam's windows with its token appended, and the beams
that go on keep their candidate's windows, so the windows are gathered by parent like the
cache. As in `generate`, an occurrence counts once the beam has `min_tokens` tokens, a
stop string counts only inside the generated text (not across the prompt), and a beam that
matches ends as a finished hypothesis, exactly as a stop token does: its `token_ids` keep
the tokens that completed the match, `num_generated` counts them, and its `text` is cut
before the stop string (kept with `include_stop_str_in_output` in `params`); a stop
sequence stays in the text, as in `generate`. The number of candidates stays
transformers' `max(2, 1 + n_stop) * K` (n_stop counts stop token ids only), so when more
than `C - K` candidates end on stop strings the running set is filled with masked beams,
as transformers does when a stopping criterion ends them.

Relation to transformers' `generate(num_beams=..., stop_strings=..., tokenizer=...)`
(`StopStringCriteria`, a stopping criterion): there too it is evaluated on each of the top
C candidates after step 2, and a candidate that hits it is handled like an EOS (masked out
of the running beams, pooled if among the first K), so the searches agree whenever the
same candidates match. Differences: transformers matches on the full sequence, so an
occurrence may begin inside the prompt (it must end in the last token); it ignores
`min_new_tokens` for stop strings (that only suppresses EOS); and its sequences decode to
a text that still holds the stop string. Stop sequences of token ids have no transformers
argument (a custom `StoppingCriteria` on the last tokens behaves as here).

The results are the pool, best first: `Beam.score` is transformers' `sequences_scores`.
Unfinished and masked candidates are pushed down by -1e9, in transformers' order of
additions, so that the float32 arithmetic, and so the ties, are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.engine.host import (
    FINISH_REASON,
    MIN_BUFFER_BUCKET,
    bucket,
    check_context,
    check_count,
    prompt_batch,
    row_stops,
    row_text,
    stop_tables,
    tokenize_prompts,
)
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.loop import stop_strings
from logitloop.decoding.loop.decode_loop import (
    FINISH_LENGTH,
    FINISH_STOP_SEQUENCE,
    FINISH_STOP_STRING,
    FINISH_STOP_TOKEN,
    forward_prompt,
    push_token,
    sequence_hits,
)
from logitloop.decoding.loop.runner import ModelRunner, runner_jit
from logitloop.decoding.loop.stop_strings import StopStrings
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.decoding.sampling.sampler import adjust_logits, raw_normalizer
from logitloop.models.kv import Rows

# transformers' mask for finished, full or closed candidates: added, not assigned.
MASK = -1.0e9


@dataclasses.dataclass
class Beam:
    """One finished hypothesis."""

    token_ids: list[int]  # the generated tokens, a final stop token, sequence or the
    # tokens of a stop string included
    score: float  # sum of its log-probabilities / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (a stop token id, EOS included, a stop sequence or string)
    # or "length"
    text: str | None = None  # with a tokenizer: without a final stop token, cut before a
    # stop string (as `generate`'s text)
    stop_reason: Any = None  # as `generate`'s: the stop token id, stop sequence (ids) or
    # stop string it ended on; None for "length"


@struct.dataclass
class BeamState:
    """The search's loop state. n prompts, K beams, R = n * K rows, N the buffer, C the
    candidates per prompt (`max(2, 1 + n_stop) * K`)."""

    step: jax.Array  # [] i32, tokens generated so far by every running beam
    going: jax.Array  # [] bool, the search goes on
    logits: jax.Array  # [R, V] f32, each running beam's next-token logits
    cache: Any  # the model's KV cache, R rows
    history: History  # [R, P + N]: prompt and the beam's tokens
    processor_states: tuple  # every leaf [R, ...]
    tokens: jax.Array  # [n, K, N] i32, the running beams' tokens, -1 past `step`
    sums: jax.Array  # [n, K] f32, their log-probability sums (MASK + ... when dead)
    pool_tokens: jax.Array  # [n, K, N] i32, finished hypotheses, best first
    pool_scores: jax.Array  # [n, K] f32, their scores (MASK when the slot is empty)
    pool_len: jax.Array  # [n, K] i32
    pool_finished: jax.Array  # [n, K] bool, the slot holds a hypothesis
    pool_finish: jax.Array  # [n, K] i32, how it ended (a FINISH_* code of the decode loop)
    window: jax.Array  # [R, L] i32, each beam's last L tokens (stop sequences), -1 before
    text_window: jax.Array  # [R, W] i32, each beam's last W bytes of text (stop strings)
    open: jax.Array  # [n] bool, the prompt may still take hypotheses (heuristic)
    beams: jax.Array  # [n] i32, the prompt's own beam count b <= K (rows and slots past it
    # are dead: sums -inf, pool slots never read)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [n, M, ...] at idx [n, J] along axis 1 -> [n, J, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def _select(
    s: BeamState,
    params: SamplingParams,
    penalty: jax.Array,  # [N + 1] f32: length ** length_penalty, as transformers rounds it
    max_tokens: jax.Array,  # [] i32
    num_candidates: int,
    early_stopping: bool | str,
    positive_penalty: jax.Array,  # [] bool
    stops: StopStrings | None,  # n * C rows: each prompt's stop strings C times
) -> tuple[BeamState, jax.Array, jax.Array]:
    """One step of the rule (module docstring) on the logits in `s`: the new running beams
    and pool, and each new row's parent row [R] and token [R].

    A prompt with b < K beams sees what a search of b beams would: its first
    `num_candidates * b / K` candidates, its first b pool slots; its other rows stay dead."""
    n, k, buf = s.tokens.shape
    rows, vocab = s.logits.shape
    raw_max, raw_norm, _ = raw_normalizer(s.logits)
    logp = (s.logits - raw_max[:, None]) - raw_norm[:, None]  # [R, V]
    positions = jnp.full((rows,), s.step, jnp.int32)
    scores = adjust_logits(
        logp, params, positions, s.history, states=s.processor_states
    ).adjusted  # [R, V]
    total = scores.reshape(n, k, vocab) + s.sums[:, :, None]
    vals, idx = jax.lax.top_k(total.reshape(n, k * vocab), num_candidates)  # [n, C]
    parent, tok = idx // vocab, (idx % vocab).astype(jnp.int32)
    seqs = _gather(s.tokens, parent)  # [n, C, N]
    seqs = seqs.at[:, :, s.step].set(tok)
    stop_ids = params.stop_token_ids.reshape(n, k, -1)[:, 0]  # [n, Ns]
    hit_token = jnp.any(tok[:, :, None] == stop_ids[:, None, :], axis=2)
    hit_seq, hit_str, window, text_window = _stop_hits(
        s, params, parent, tok, num_candidates, stops
    )
    ends = hit_token | hit_seq | hit_str | (s.step + 1 >= max_tokens)
    finish = jnp.where(
        hit_token,
        FINISH_STOP_TOKEN,
        jnp.where(
            hit_seq, FINISH_STOP_SEQUENCE, jnp.where(hit_str, FINISH_STOP_STRING, FINISH_LENGTH)
        ),
    ).astype(jnp.int32)  # [n, C], the decode loop's priority
    rank = jnp.arange(num_candidates)[None, :]  # [1, C]
    cand_ok = rank < (num_candidates // k) * s.beams[:, None]  # [n, C]
    slot_ok = jnp.arange(k)[None, :] < s.beams[:, None]  # [n, K]

    # Running beams: the best b candidates that do not end.
    running = jnp.where(cand_ok, vals + ends.astype(jnp.float32) * MASK, -jnp.inf)
    run_vals, run_idx = jax.lax.top_k(running, k)
    run_vals = jnp.where(slot_ok, run_vals, -jnp.inf)
    new_parent = jnp.take_along_axis(parent, run_idx, axis=1)  # [n, K]
    new_tok = jnp.take_along_axis(tok, run_idx, axis=1)

    # The pool: the first K candidates that end, length-normalised.
    just_done = ends & (rank < s.beams[:, None])
    cand = vals / penalty[s.step + 1]
    pool_full = jnp.all(s.pool_finished | ~slot_ok, axis=1, keepdims=True)
    full = pool_full & (early_stopping is True)
    cand = cand + full.astype(jnp.float32) * MASK
    cand = cand + (~s.open)[:, None].astype(jnp.float32) * MASK
    cand = cand + (~just_done).astype(jnp.float32) * MASK
    pool_scores, pick = jax.lax.top_k(jnp.concatenate([s.pool_scores, cand], axis=1), k)
    length = jnp.full((n, num_candidates), s.step + 1, jnp.int32)
    pool_tokens = _gather(jnp.concatenate([s.pool_tokens, seqs], axis=1), pick)
    pool_len = _gather(jnp.concatenate([s.pool_len, length], axis=1), pick)
    pool_finished = _gather(jnp.concatenate([s.pool_finished, just_done], axis=1), pick)
    pool_finish = _gather(jnp.concatenate([s.pool_finish, finish], axis=1), pick)

    # Can a running beam still beat the worst pooled hypothesis?
    step = s.step + 1
    best_len = jnp.where((early_stopping == "never") & positive_penalty, max_tokens, step)
    best = run_vals[:, 0] / penalty[best_len]
    lowest = jnp.min(jnp.where(slot_ok, pool_scores, jnp.inf), axis=1, keepdims=True)
    worst = jnp.where(pool_finished, lowest, MASK)
    still_open = s.open & jnp.any((best[:, None] > worst) & slot_ok, axis=1)
    going = jnp.any(still_open) & ~jnp.all(ends | ~cand_ok)
    if early_stopping is True:
        going = going & ~jnp.all(pool_finished | ~slot_ok)
    s = s.replace(
        step=step,
        going=going,
        tokens=_gather(seqs, run_idx),
        sums=run_vals,
        pool_tokens=pool_tokens,
        pool_scores=pool_scores,
        pool_len=pool_len,
        pool_finished=pool_finished,
        pool_finish=pool_finish,
        open=still_open,
        window=_gather(window, run_idx).reshape(rows, -1),
        text_window=_gather(text_window, run_idx).reshape(rows, -1),
    )
    parent_rows = (jnp.arange(n)[:, None] * k + new_parent).reshape(rows)
    return s, parent_rows, new_tok.reshape(rows)


def _stop_hits(
    s: BeamState,
    params: SamplingParams,
    parent: jax.Array,  # [n, C] i32, each candidate's beam
    tok: jax.Array,  # [n, C] i32, its token
    num_candidates: int,
    stops: StopStrings | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The decode loop's stop-sequence and stop-string checks on every candidate: its
    parent's windows with its token appended. Returns (hit_seq [n, C] bool, hit_str [n, C]
    bool, the candidates' windows [n, C, L] and text windows [n, C, W])."""
    n, c = tok.shape
    k = s.tokens.shape[1]
    flat_tok = tok.reshape(n * c)

    def per_candidate(x):  # [R, ...] per-beam rows -> [n * C, ...], each prompt's row C times
        return jnp.repeat(x.reshape((n, k) + x.shape[1:])[:, 0], c, axis=0)

    rows = (jnp.arange(n)[:, None] * k + parent).reshape(n * c)  # the parents' rows
    num = jnp.full((n * c,), s.step + 1, jnp.int32)
    min_tokens = per_candidate(params.min_tokens)
    window = push_token(s.window[rows], flat_tok)  # [n * C, L]
    hits = sequence_hits(per_candidate(params.stop_sequences), window, num, min_tokens)
    hit_seq = jnp.any(hits, axis=1)
    text_window = s.text_window[rows]  # [n * C, W]
    if stops is None:
        hit_str = jnp.zeros_like(hit_seq)
    else:
        text_window, hit_str, _ = stop_strings.advance(
            text_window, stops, flat_tok, jnp.ones((n * c,), bool)
        )
        hit_str = hit_str & (num >= min_tokens)
    return (
        hit_seq.reshape(n, c),
        hit_str.reshape(n, c),
        window.reshape(n, c, -1),
        text_window.reshape(n, c, -1),
    )


@functools.partial(
    runner_jit, static_argnames=("runner", "num_beams", "num_candidates", "early_stopping")
)
def search(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [n, P] i32, left-padded
    positions: jax.Array,  # [n, P] i32, -1 on padding
    prompt_len: jax.Array,  # [n] i32
    history: History,  # [n, P + N]
    params: SamplingParams,  # R = n * K rows
    penalty: jax.Array,  # [N + 1] f32
    max_tokens: jax.Array,  # [] i32
    positive_penalty: jax.Array,  # [] bool
    beams: jax.Array,  # [n] i32, each prompt's beam count, at most num_beams
    stops: StopStrings | None,  # n * num_candidates rows
    prompt_rows: Rows | None = None,  # the n prompts' adapters (`ll.Rows`), or None
    *,
    num_beams: int,
    num_candidates: int,
    early_stopping: bool | str,
) -> BeamState:
    """Prefill the n prompts once, copy each into its K rows, and search."""
    n, plen = prompt.shape
    buf = penalty.shape[0] - 1
    k = num_beams
    logits, cache = forward_prompt(runner, weights, prompt, positions, plen + buf, rows=prompt_rows)

    def per_beam(x):  # [n, ...] -> [n * K, ...], each prompt's row K times
        return jnp.repeat(x, k, axis=0)

    # A prompt's beams keep its adapter (a beam's parent is a beam of the same prompt).
    beam_rows = None
    if prompt_rows is not None:
        beam_rows = prompt_rows.replace(adapter=per_beam(prompt_rows.adapter))

    rows = n * k
    row_prompt_len = per_beam(prompt_len)
    state = BeamState(
        step=jnp.zeros((), jnp.int32),
        going=jnp.ones((), bool),
        logits=per_beam(logits.astype(jnp.float32)),
        cache=jax.tree.map(per_beam, cache),
        history=jax.tree.map(per_beam, history),
        processor_states=procs.init_states(params.processors, rows, logits.shape[1]),
        tokens=jnp.full((n, k, buf), -1, jnp.int32),
        # Only the first beam is live at first, so that the K copies give distinct beams.
        sums=jnp.where(
            jnp.arange(k)[None, :] < beams[:, None],
            jnp.where(jnp.arange(k) == 0, 0.0, MASK)[None, :],
            -jnp.inf,
        ),
        pool_tokens=jnp.full((n, k, buf), -1, jnp.int32),
        pool_scores=jnp.full((n, k), MASK, jnp.float32),
        pool_len=jnp.zeros((n, k), jnp.int32),
        pool_finished=jnp.zeros((n, k), bool),
        pool_finish=jnp.zeros((n, k), jnp.int32),
        window=jnp.full((rows, params.stop_sequences.shape[2]), -1, jnp.int32),
        text_window=stop_strings.empty_window(rows, stops)
        if stops is not None
        else jnp.zeros((rows, 0), jnp.int32),
        open=jnp.ones((n,), bool),
        beams=beams.astype(jnp.int32),
    )

    def body(s: BeamState) -> BeamState:
        step_positions = jnp.full((rows,), s.step, jnp.int32)
        new, parent, tok = _select(
            s, params, penalty, max_tokens, num_candidates, early_stopping, positive_penalty,
            stops,
        )  # fmt: skip
        history = jax.tree.map(lambda x: x[parent], s.history)
        states = jax.tree.map(lambda x: x[parent], s.processor_states)
        if params.processors:
            step = procs.Step(
                positions=step_positions, history=history, done=jnp.zeros((rows,), bool)
            )
            states = procs.update_all(params.processors, states, tok, step)
        cache = jax.tree.map(lambda x: x[parent], s.cache)

        def forward(cache):
            pos = (row_prompt_len + s.step)[:, None]  # the new token's position
            out, cache = runner.forward(weights, tok[:, None], pos, cache, rows=beam_rows)
            return out.astype(jnp.float32), cache

        logits, cache = jax.lax.cond(new.going, forward, lambda c: (s.logits, c), cache)
        return new.replace(
            logits=logits,
            cache=cache,
            history=history.append(tok),
            processor_states=states,
        )

    return jax.lax.while_loop(lambda s: s.going, body, state)


def _length_penalties(buf: int, length_penalty: float) -> np.ndarray:
    """[buf + 1] f32: `length ** length_penalty` computed in float64 and rounded, as
    transformers divides a float32 tensor by a Python float."""
    return np.asarray([float(max(n, 1)) ** length_penalty for n in range(buf + 1)], np.float32)


def beam_search(
    model: Any,
    prompts: Sequence[Any],
    *,
    num_beams: int | Sequence[int],
    max_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = True,
    num_return_sequences: int = 1,
    stop_token_ids: Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    params: SamplingParams | None = None,
    processors: Sequence[Any] | None = None,
    deterministic: bool | str = False,
    adapters: Any = None,
    adapter: Any = None,
) -> list[list[Beam]]:
    """Beam search with transformers' rules: for each prompt, its `num_return_sequences`
    best hypotheses (`Beam`), best first.

    The rule (module docstring): every step keeps the `max(2, 1 + n_stop) * num_beams` best
    continuations of all beams by summed log-probability; among the first `num_beams` of
    them, those that end (a stop token id, EOS included unless `ignore_eos`, a stop
    sequence, a stop string, or `max_tokens`) enter a pool of `num_beams` finished hypotheses scored
    `sum_logprobs / num_generated ** length_penalty` (num_generated counts the stop
    token); the best `num_beams` that do not end continue. `early_stopping`: True stops a
    prompt once its pool is full; False once the best running beam, scored at its current
    length, cannot beat the pool's worst; "never" the same with `max_tokens` as the length
    when `length_penalty > 0`. So `sequences` and `sequences_scores` of transformers'
    `generate(num_beams=..., do_sample=False, length_penalty=..., early_stopping=...)`
    are the `token_ids` and `score` returned here.

    `stop` (a string or a list, or one list per prompt) and `stop_sequences` (token-id
    lists, or one such list per prompt) end a beam as a stop token does, from `min_tokens`
    tokens on; its `text` is cut before the stop string (module docstring: the rule, and
    how it relates to transformers' `stop_strings=`). Give them here or in `params`.

    `min_tokens` suppresses the stop ids before that many tokens; `params` (one row per
    prompt, optional) adds its masks, bias, penalties, min_tokens and stop rules, and
    `processors` user processors, all applied to the log-probabilities as transformers
    applies logits processors in beam search. The whole search is one compiled
    `lax.while_loop` over n * num_beams rows.

    `num_beams` may be a list, one count per prompt: each prompt then gets what a search
    with its own count gives (rows past it stay idle in the batch of `max(num_beams)`).

    `adapters`, `adapter`: LoRA adapters and each prompt's (its beams') adapter by name,
    as in `generate` (docs/lora.md).
    """
    options = Options(deterministic=deterministic, adapters=adapters, adapter=adapter)
    info = plan(model, options, adapters=True).info
    ids = tokenize_prompts(prompts, info)
    n = len(ids)
    prompt_rows = None
    if adapters is not None:
        prompt_rows = Rows(jax.device_put(adapters.slots(adapter, n)), adapters.table)
    if isinstance(num_beams, (list, tuple, np.ndarray)):
        if len(num_beams) != n:
            raise ValueError(f"num_beams has {len(num_beams)} entries but there are {n} prompts")
        beams = [
            check_count(f"num_beams[{r}]", b, 1, info.vocab_size) for r, b in enumerate(num_beams)
        ]
    else:
        beams = [check_count("num_beams", num_beams, 1, info.vocab_size)] * n
    k = max(beams)
    check_count("num_return_sequences", num_return_sequences, 1, min(beams))
    check_count("max_tokens", max_tokens, 1)
    check_count("min_tokens", min_tokens, 0, max_tokens)
    number = (int, float, np.integer, np.floating)
    if isinstance(length_penalty, (bool, np.bool_)) or not isinstance(length_penalty, number):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty = {length_penalty} is not finite")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    for row, p in enumerate(ids):
        check_context(f"prompts[{row}]", p, max_tokens, info)
    params = _beam_params(
        params, n, min_tokens, stop_token_ids, max_tokens, info, ignore_eos, stop, stop_sequences
    )
    if processors is not None:
        params = params.replace(processors=procs.as_tuple(processors, n))
    stop_rows = [[t for t in r if t >= 0] for r in np.asarray(params.stop_token_ids)]
    num_candidates = max(2, 1 + max(len(r) for r in stop_rows)) * k
    if num_candidates > k * info.vocab_size:
        raise ValueError(
            f"num_beams = {k} needs {num_candidates} candidates per step, more than the "
            f"{k * info.vocab_size} a vocabulary of {info.vocab_size} tokens gives"
        )
    buf = bucket(max_tokens, MIN_BUFFER_BUCKET)
    batch = prompt_batch(ids, buf)
    stops = stop_tables(info, [row for row in params.stop for _ in range(num_candidates)])
    state = search(
        info.runner, info.weights, batch.prompt, batch.positions, batch.lengths, batch.history,
        params.samples(k).device_only(), _length_penalties(buf, float(length_penalty)),
        np.int32(max_tokens), np.bool_(length_penalty > 0), np.asarray(beams, np.int32), stops,
        prompt_rows, num_beams=k, num_candidates=num_candidates,
        early_stopping=early_stopping if isinstance(early_stopping, str) else bool(early_stopping),
    )  # fmt: skip
    tokens, scores, lengths, finish = jax.device_get(
        (state.pool_tokens, state.pool_scores, state.pool_len, state.pool_finish)
    )
    out = []
    for r in range(n):
        beams = []
        strings, include, row_min = row_stops(params, r)
        seqs = [[int(t) for t in q if t >= 0] for q in np.asarray(params.stop_sequences)[r]]
        for b in range(num_return_sequences):
            seq = tokens[r, b, : int(lengths[r, b])].tolist()
            code = int(finish[r, b])
            text = string = None
            if info.tokenizer is not None:
                text, string = row_text(info.tokenizer, seq, code, strings, include, row_min)
            reason = {
                FINISH_STOP_TOKEN: seq[-1],
                FINISH_STOP_SEQUENCE: next((q for q in seqs if q and seq[-len(q) :] == q), None),
                FINISH_STOP_STRING: string,
            }.get(code)
            beams.append(Beam(seq, float(scores[r, b]), FINISH_REASON[code], text, reason))
        out.append(beams)
    return out


def _beam_params(
    params: SamplingParams | None,
    n: int,
    min_tokens: int,
    stop_token_ids: Sequence[int] | None,
    max_tokens: int,
    info: Any,
    ignore_eos: bool,
    stop: Any = None,
    stop_sequences: Any = None,
) -> SamplingParams:
    """The rows' steps 1-3 settings and stop rules: `params` (checked: no sampling knobs
    nor constraints, which beam search does not take) or the defaults with `stop` and
    `stop_sequences`, plus `min_tokens`, `stop_token_ids` and the model's EOS ids."""
    if params is None:
        params = SamplingParams.create(
            n, max_tokens=max_tokens, vocab_size=info.vocab_size, stop=stop,
            stop_sequences=stop_sequences,
        )  # fmt: skip
    elif not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
    elif stop is not None or stop_sequences is not None:
        raise ValueError("give stop and stop_sequences in params or as arguments, not both")
    params = params.broadcast_to(n)
    params.check_vocab(info.vocab_size)
    host = jax.device_get(params.device_only())
    for name, bad in (
        ("temperature", host.temperature != 1.0),
        ("top_k", (host.top_k > 0) & (host.top_k < info.vocab_size)),
        ("top_p", host.top_p < 1.0),
        ("min_p", host.min_p > 0.0),
    ):
        if np.any(bad):
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"params.{name}[{row}] is set, but beam search is deterministic: leave it at "
                "its default"
            )
    if any(c is not None for c in params.constraints):
        raise ValueError("params: beam search takes no json_schema/regex/choice")
    if min_tokens:
        params = params.replace(min_tokens=jax.device_put(np.full((n,), min_tokens, np.int32)))
    extra = [] if stop_token_ids is None else [int(t) for t in stop_token_ids]
    for t in extra:
        if not 0 <= t < info.vocab_size:
            raise ValueError(
                f"stop_token_ids holds {t}, outside the vocabulary range [0, {info.vocab_size - 1}]"
            )
    if not ignore_eos:
        extra += [e for e in info.eos_token_ids if e not in extra]
    return params.with_stop_token_ids(extra) if extra else params
