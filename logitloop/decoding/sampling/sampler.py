"""The sampler: one jit-compiled step from logits `[B, V]` to one token per row.

Per row, in this order (each step is one pure function in `transforms.py` or
`logitloop.ops.sampling`):

1. Token masks and bias: `allowed_token_ids` (everything else to -inf), a constraint's
   allowed-token bitmask (`allowed_bits`, `logitloop.decoding.sampling.constraints`), `logit_bias`
   added, `banned_token_ids` to -inf. A banned or disallowed token stays -inf whatever its
   bias.
2. `min_tokens`: while the row has generated fewer than `min_tokens` tokens
   (`positions < min_tokens`), every stop token id is -inf.
3. Penalties (need `history`): repetition penalty over prompt and generated tokens (positive
   logits divided, negative multiplied, once per distinct token); presence and frequency
   over generated tokens: `logit -= frequency * count + presence * (count > 0)`.
   Then the user's processors (`params.processors`, `logitloop.decoding.sampling.processors`), in
   list order, except those that run after temperature.
4. Temperature: divide by T, as a product with the float32 reciprocal 1 / T (the same bits
   wherever a logit is scaled; `ops.sampling.xla.scale_logits`). `temperature == 0` is
   greedy: the argmax after steps 1-3, ties to the lowest token id. `top_k == 1` is greedy
   too, bit for bit the same. Then the processors with `after_temperature = True`.
5. top-k: keep every token whose logit is at least the k-th largest (ties kept);
   `top_k <= 0` or `>= V` disables it.
6. top-p over the top-k survivors renormalised: the smallest set of most likely tokens whose
   mass reaches p, plus every token tied with the last one kept; `top_p == 1` is an identity.
7. min-p: keep tokens with `prob >= min_p * max_prob`; `min_p == 0` is an identity.
   Then the processors with `after_filters = True`, on the scaled logits with the cut
   tokens at -inf (typical sampling, the watermarks); the draw filters no more.
8. Draw from the renormalised survivors with the row's own random stream, keyed by
   `(seed, position)` only (`jax.random.fold_in`): a row's token does not depend on which
   rows share the batch or where it sits.

Of the params (`SamplingParams`) the steps read the `knobs` part only, but for step 2,
which reads the stop rules' `stop_token_ids` and `min_tokens`, the processors, and the
output options' `logprobs` (how many top alternatives a row reports).

Rows that cannot be sampled get a defined outcome, never NaN or an out-of-vocabulary id:
logits holding NaN or +inf (or a processor writing +inf) give `status == STATUS_BAD_LOGITS`,
rows where steps 1-2 or a processor mask every token give `status == STATUS_ALL_MASKED`;
both return token 0 with log-probabilities -inf, and `generate` ends such a row with
finish_reason "error".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling import transforms
from logitloop.decoding.sampling.history import History, distinct_tokens
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.ops.sampling import Thresholds, filter_and_sample, noise
from logitloop.ops.sampling.dispatch import resolve_backend
from logitloop.ops.sampling.noise import row_keys
from logitloop.ops.sampling.xla import (
    NUM_CANDIDATES,
    SINGLE,
    Axes,
    candidates,
    rules_off_on_greedy,
    scale_logits,
    thresholds,
)
from logitloop.ops.sampling.xla import filter_and_sample as xla_filter_and_sample

STATUS_OK = 0
STATUS_ALL_MASKED = 1
STATUS_BAD_LOGITS = 2
NEG_INF = float("-inf")


@struct.dataclass
class TopLogprobs:
    """The top-n alternatives under the model's own logits (raw log-softmax).

    K is the params' `top_logprobs_width`, the most any row asks for (static: one compile
    per width; a new `logprobs` value within it compiles nothing): row r's first
    `logprobs[r]` columns are its alternatives, and the rest are padded with id -1 and value
    -inf (`generate`'s results hold each row's n only).
    """

    ids: jax.Array  # [B, K] i32, best first; -1 past the row's n
    values: jax.Array  # [B, K] f32; -inf past the row's n


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B] i32, always in [0, V)
    logprobs: jax.Array  # [B] f32, log-prob of the token under the final distribution
    raw_logprobs: jax.Array  # [B] f32, log_softmax(logits)[token]
    top_logprobs: TopLogprobs
    status: jax.Array  # [B] i32, STATUS_OK / STATUS_ALL_MASKED / STATUS_BAD_LOGITS
    states: tuple = ()  # the processors' states after this token (every row)


@struct.dataclass
class Processed:
    """Intermediate results of one step, for `sample` and for inspection (`explain`)."""

    raw: jax.Array  # [B, V] f32, the model's logits
    raw_max: jax.Array  # [B] f32, row max of the raw logits (0 on bad rows)
    raw_norm: jax.Array  # [B] f32, log(sum(exp(raw - raw_max)))
    penalized: jax.Array  # [B, V] f32, after masks, bias, min_tokens and penalties (steps 1-3)
    adjusted: jax.Array  # [B, V] f32, `penalized` after the processors that precede step 4
    temperature: jax.Array  # [B] f32, the temperature applied: 0 on greedy rows
    greedy: jax.Array  # [B] bool
    bad: jax.Array  # [B] bool, logits hold NaN or +inf
    # Static: top-k, top-p and min-p were applied already (`adjusted` holds -inf where they
    # cut), for the processors that run after them; the callers then filter no more.
    filtered: bool = struct.field(pytree_node=False, default=False)

    def rules(self, knobs) -> tuple[jax.Array, jax.Array, jax.Array]:
        """top_k, top_p, min_p [B] for the steps after: the row's own, or every filter off
        where they ran already (`filtered`)."""
        if not self.filtered:
            return knobs.top_k, knobs.top_p, knobs.min_p
        return (
            jnp.zeros_like(knobs.top_k),
            jnp.ones_like(knobs.top_p),
            jnp.zeros_like(knobs.min_p),
        )

    @property
    def scaled(self) -> jax.Array:
        """[B, V] f32, after temperature (step 4), NaN replaced by -inf.

        `sample` never writes this array out: it reads `adjusted` and scales what it needs.
        """
        return scale_logits(self.adjusted, self.temperature)

    def status(self, row_max: jax.Array | None = None) -> jax.Array:
        """[B] i32 status; `row_max`, the max of `scaled` when the caller already has it."""
        if row_max is None:
            row_max = jnp.max(self.scaled, axis=1)
        all_masked = row_max == NEG_INF
        # +inf can only come from a processor: steps 1-4 saturate at the float32 maximum.
        bad = self.bad | (row_max == jnp.inf)
        status = jnp.where(
            bad, STATUS_BAD_LOGITS, jnp.where(all_masked, STATUS_ALL_MASKED, STATUS_OK)
        )
        return status.astype(jnp.int32)


def raw_normalizer(raw: jax.Array, axes: Axes = SINGLE) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw log-softmax's parts over the last axis of float32 logits `raw` [..., V]:
    (max, log-sum, bad), each [...]; `log_softmax(raw)[t] = (raw[t] - max) - log_sum`.

    bad: the row holds NaN or +inf (its max is then 0). `adjust_logits` and `ll.score` take
    a token's raw log-probability from these, so the two agree bit for bit."""
    raw_max = axes.max(jnp.max(raw, axis=-1))
    shift = jnp.where(jnp.isfinite(raw_max), raw_max, 0.0)
    # Kept relative to the max: at |logits| ~ 1e4 an absolute logsumexp loses ~1e-3.
    raw_sum = axes.sum(jnp.sum(jnp.exp(raw - shift[..., None]), axis=-1))
    # Bad rows, found without a pass of their own: a sum propagates NaN (a vectorised max on
    # XLA:CPU may skip it), and +inf is the max or, where a NaN hid it, a NaN in the sum.
    # Finite rows sum to >= 1 and all -inf rows to 0, so neither looks bad.
    bad = jnp.isnan(raw_sum) | (raw_max == jnp.inf)
    return jnp.where(bad, 0.0, shift), jnp.log(raw_sum), bad


def adjust_logits(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None,
    axes: Axes = SINGLE,
    states: tuple = (),
    done: jax.Array | None = None,
    allowed_bits: jax.Array | None = None,
) -> Processed:
    """Steps 1-4: masks and bias, min_tokens, penalties, processors, temperature.

    `axes`: inside `shard_map`, where `logits` is this device's slice of the vocabulary
    (`ops.sampling.xla.Axes`): token ids are mapped to its columns, row statistics reduced
    over the vocabulary axis. `states`: the processors' states (`params.processors`);
    `done`: [B] rows that stopped, for the processors' `Step` (default none);
    `allowed_bits`: [B, ceil(V / 32)] u32 each row's allowed-token bitmask (a constraint's
    state, `constraints.row_bits`), or None.
    """
    raw = logits.astype(jnp.float32)
    width = raw.shape[1]
    raw_max, raw_norm, bad = raw_normalizer(raw, axes)

    def local(ids):
        return axes.local_ids(ids, width)

    knobs, stops = params.knobs, params.stops
    z = transforms.allowed_mask(raw, local(knobs.allowed_ids), knobs.has_allowed)
    if allowed_bits is not None:
        z = transforms.allowed_bitmask(z, allowed_bits, axes.offset(width))
    z = transforms.logit_bias(z, local(knobs.bias_ids), knobs.bias_values)
    z = transforms.ban_tokens(z, local(knobs.banned_ids))
    z = transforms.suppress_stop_tokens(z, local(stops.stop_token_ids), positions, stops.min_tokens)
    if history is not None:
        seen = distinct_tokens(history)
        if axes.vocab is not None:  # this device's columns only
            ids = seen.ids - axes.offset(width)
            mine = (ids >= 0) & (ids < width)
            seen = seen.replace(ids=jnp.where(mine, ids, 0), is_distinct=seen.is_distinct & mine)
        z = transforms.repetition_penalty(z, seen, knobs.repetition_penalty)
        z = transforms.presence_frequency_penalty(
            z, seen, knobs.presence_penalty, knobs.frequency_penalty
        )
    greedy = (knobs.temperature == 0) | (knobs.top_k == 1)
    penalized = z
    temperature = jnp.where(greedy, 0.0, knobs.temperature)
    filtered = False  # static: top-k, top-p and min-p ran already (processors after them)
    if params.processors:
        if axes.vocab is not None:
            raise ValueError("processors need whole rows of the vocabulary on each device")
        done = jnp.zeros(positions.shape, bool) if done is None else done
        step = procs.Step(positions=positions, history=history, done=done)
        z = procs.apply_all(params.processors, states, z, step, where="early")
        places = {procs.place(p) for p in params.processors}
        if places & {"late", "filtered"}:
            z = scale_logits(z, temperature)
            temperature = jnp.where(greedy, 0.0, 1.0)  # `adjusted` is scaled from here
            z = procs.apply_all(params.processors, states, z, step, where="late")
        filtered = "filtered" in places
        if filtered:
            z = _filtered(z, knobs, greedy)
            z = procs.apply_all(params.processors, states, z, step, where="filtered")
    return Processed(
        raw=raw,
        raw_max=raw_max,
        raw_norm=raw_norm,
        penalized=penalized,
        adjusted=z,
        # Greedy rows stay unscaled so that temperature 0 and top_k 1 pick the same argmax.
        temperature=temperature,
        greedy=greedy,
        bad=bad,
        filtered=filtered,
    )


def _filtered(x: jax.Array, knobs, greedy: jax.Array) -> jax.Array:
    """[B, V] the scaled logits `x` with the tokens top-k, top-p and min-p cut at -inf (a
    greedy row: unchanged)."""
    top_k, top_p, min_p = rules_off_on_greedy(knobs.top_k, knobs.top_p, knobs.min_p, greedy)
    cand_x, _ = candidates(x, min(NUM_CANDIDATES, x.shape[1]))
    thr = thresholds(x, top_k, top_p, min_p, cand_x)
    return jnp.where(x >= thr.kept[:, None], x, NEG_INF)


def _top_logprobs(raw_logp: jax.Array, n: jax.Array, axes: Axes, width: int) -> TopLogprobs:
    k = min(width, axes.vocab_size(raw_logp))
    if axes.vocab is None:
        vals, ids = jax.lax.top_k(raw_logp, k)
    else:
        vals, ids = candidates(raw_logp, k, axes)
    pad = ((0, 0), (0, width - k))  # vocabularies smaller than the width
    vals = jnp.pad(vals, pad, constant_values=NEG_INF)
    ids = jnp.pad(ids, pad, constant_values=-1)
    keep = jnp.arange(width)[None, :] < n[:, None]
    return TopLogprobs(
        ids=jnp.where(keep, ids, -1).astype(jnp.int32), values=jnp.where(keep, vals, NEG_INF)
    )


def _no_top_logprobs(batch: int, width: int) -> TopLogprobs:
    return TopLogprobs(
        ids=jnp.full((batch, width), -1, jnp.int32),
        values=jnp.full((batch, width), NEG_INF, jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("backend",))
def sample(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None = None,
    *,
    processors: tuple | list | None = None,
    states: tuple | None = None,
    allowed_bits: jax.Array | None = None,
    backend: str = "auto",
) -> SampleOutput:
    """Draw one token per row under the row's own settings (see the module docstring).

    logits: [B, V] float32, bfloat16 or float16 (arithmetic is float32); params: a
    `SamplingParams` of batch B; positions: [B] int, the 0-based index among the row's
    generated tokens of the token being drawn (it keys the random stream with the seed and
    drives `min_tokens`); history: the prompt and generated tokens, needed for the
    penalties (without it the penalties are not applied). On a mesh the decode loop runs
    this same step under `shard_map` (`sample_step` with `axes`).

    processors: user transforms (`logitloop.decoding.sampling.processors`), each a pytree with [B]
    leaves; states: their states (default: each one's `init`). The output's `states` are
    the states after the drawn tokens. allowed_bits: [B, ceil(V / 32)] u32 allowed-token
    bitmasks (a constraint's, `logitloop.decoding.sampling.constraints.row_bits`), or None.

    The output's `top_logprobs` are exactly as wide as the widest row asked
    (`params.top_logprobs_width`, static, set by `create`; 0 wide when no row asks): row r's
    are its first `params.logprobs[r]` columns, -1 / -inf after them (`TopLogprobs`). So
    each new width compiles once (at most 21 programs), and a new `logprobs` value within
    it compiles nothing. Randomness comes from each row's explicit
    `seed` and `positions` only (JAX's convention): the same inputs give the same tokens.
    """
    params = check_shapes("ll.sample", logits, params, positions, history)
    check_constraint_masks("ll.sample", params, allowed_bits)
    params, states = with_processors("ll.sample", logits, params, processors, states)
    return sample_step(
        logits,
        params,
        positions,
        history,
        states=states,
        allowed_bits=allowed_bits,
        backend=backend,
    )


def with_processors(
    name: str, logits: jax.Array, params: SamplingParams, processors, states
) -> tuple[SamplingParams, tuple]:
    """`params` carrying `processors` (when given) and their states (default: `init`)."""
    batch, vocab = jnp.shape(logits)
    if processors is not None:
        params = params.replace(processors=procs.as_tuple(processors, batch))
    if states is None:
        return params, procs.init_states(params.processors, batch, vocab)
    states = tuple(states)
    if len(states) != len(params.processors):
        raise ValueError(
            f"{name}: {len(states)} processor states for {len(params.processors)} processors"
        )
    return params, states


def check_shapes(
    name: str, logits: jax.Array, params: SamplingParams, positions, history
) -> SamplingParams:
    """One-line ValueErrors for inputs whose shapes do not fit together, at trace time (the
    shapes and `params.vocab_size` are static: nothing is read back from the device).
    Returns `params` for the logits' rows (a `create()` row repeated: `broadcast_to`)."""
    shape = tuple(jnp.shape(logits))
    if len(shape) != 2:
        raise ValueError(f"{name}: logits must be [B, V] (2-D), got shape {shape}")
    batch, vocab = shape
    if vocab == 0:
        raise ValueError(f"{name}: logits have V = 0 tokens (shape {shape})")
    if params.batch_size != batch and not params.broadcasts:
        raise ValueError(
            f"{name}: params has batch_size {params.batch_size} but logits have {batch} rows"
        )
    params = params.broadcast_to(batch)
    if params.vocab_size is not None and params.vocab_size > vocab:
        raise ValueError(
            f"{name}: params were checked against vocab_size = {params.vocab_size}, but the "
            f"logits have V = {vocab}: token ids up to {params.vocab_size - 1} would lie "
            "outside them"
        )
    pos_shape = tuple(jnp.shape(positions))
    if pos_shape != (batch,):
        raise ValueError(
            f"{name}: positions must be [B] = ({batch},), one per row, got shape {pos_shape}"
        )
    if history is not None and history.tokens.shape[0] != batch:
        raise ValueError(
            f"{name}: history has {history.tokens.shape[0]} rows but logits have {batch}"
        )
    for i, p in enumerate(params.processors):
        procs.check_rows(f"{name}: processors[{i}] ({type(p).__name__})", p, batch)
    return params


def check_constraint_masks(name: str, params: SamplingParams, allowed_bits) -> None:
    """Constraints (`json_schema`, `regex`, `choice`) act through their masks: params that
    carry some without `allowed_bits` would sample unconstrained, so they are refused."""
    if params.constraints and allowed_bits is None:
        raise ValueError(
            f"{name}: params carry json_schema/regex/choice constraints, which act through "
            "allowed_bits (the rows' masks, logitloop.decoding.sampling.constraints.row_bits); "
            "generate, stream and generate_many build them"
        )


def sample_step(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None,
    *,
    states: tuple = (),
    done: jax.Array | None = None,
    allowed_bits: jax.Array | None = None,
    backend: str = "auto",
    axes: Axes = SINGLE,
    choose=None,
    num_top: int | None = None,
) -> SampleOutput:
    """The sampling step, traceable anywhere: `sample` is this under `jit` on one device;
    inside `shard_map`, `axes` says how the rows and the vocabulary lie on the mesh (the
    logits are then this device's [B_s, V_s] slice, the results those of its rows).
    `states`, `done`, `allowed_bits`: the processors' states, the rows that stopped and the
    constraints' masks (`adjust_logits`).

    `choose(probs [B, V], drawn [B] i32, key [B, 2] u32) -> tokens [B]`: picks the token
    instead of the row's draw, from the final distribution (speculative decoding's
    rejection acceptance, `rejection_choice`); logprobs and processor updates follow it.
    `num_top`: the width of the top logprobs (static; at least every row's `logprobs`;
    default `params.top_logprobs_width`)."""
    if num_top is None:
        num_top = params.top_logprobs_width
    params = params.device_only()
    positions = jnp.asarray(positions, jnp.int32)
    proc = adjust_logits(logits, params, positions, history, axes, states, done, allowed_bits)
    knobs = params.knobs
    key = row_keys(knobs.seed, positions)
    top_k, top_p, min_p = proc.rules(knobs)
    if axes.vocab is None and resolve_backend(backend) == "pallas":
        drawn, thr = filter_and_sample(
            proc.scaled, top_k, top_p, min_p, proc.greedy, key, backend=backend
        )
    else:
        # Candidates and thresholds straight from the unscaled logits: no [B, V] write.
        drawn, thr = xla_filter_and_sample(
            proc.adjusted,
            top_k,
            top_p,
            min_p,
            proc.greedy,
            key,
            temperature=proc.temperature,
            axes=axes,
        )
    proc_status = proc.status(thr.row_max)
    batch = proc.raw.shape[0]
    vocab = axes.vocab_size(proc.raw)
    ok = proc_status == STATUS_OK
    drawn_logprobs = drawn.logprobs
    if choose is not None:
        if axes.vocab is not None:
            raise ValueError("speculative rejection needs whole rows of the vocabulary")
        probs = kept_distribution(proc.scaled, thr, proc.greedy)
        chosen = choose(probs, drawn.tokens, key)
        drawn = drawn.replace(tokens=chosen)
        picked = jnp.take_along_axis(probs, jnp.clip(chosen, 0, vocab - 1)[:, None], axis=1)
        drawn_logprobs = jnp.where(proc.greedy, 0.0, jnp.log(picked[:, 0]))
    tokens = jnp.where(ok, jnp.clip(drawn.tokens, 0, vocab - 1), 0)
    # The raw log-softmax at one token per row; the full [B, V] array only when top-n is asked.
    norm = jnp.where(ok, proc.raw_norm, 0.0)
    raw_tok = (axes.at(proc.raw, tokens) - proc.raw_max) - norm
    top = (
        _no_top_logprobs(batch, 0)
        if num_top == 0
        else jax.lax.cond(
            axes.any(params.output.logprobs > 0),
            lambda: _top_logprobs(
                jnp.where(ok[:, None], proc.raw - proc.raw_max[:, None], 0.0) - norm[:, None],
                jnp.where(ok, params.output.logprobs, 0),
                axes,
                num_top,
            ),
            lambda: _no_top_logprobs(batch, num_top),
        )
    )
    tokens = tokens.astype(jnp.int32)
    if params.processors:
        done = jnp.zeros(positions.shape, bool) if done is None else done
        step = procs.Step(positions=positions, history=history, done=done)
        states = procs.update_all(params.processors, states, tokens, step)
    return SampleOutput(
        tokens=tokens,
        logprobs=jnp.where(ok, drawn_logprobs, NEG_INF),
        raw_logprobs=jnp.where(ok, raw_tok, NEG_INF),
        top_logprobs=top,
        status=proc_status,
        states=tuple(states),
    )


def sub_key(key: jax.Array, stream: int) -> jax.Array:
    """[B, 2] u32: a row key's independent sub-stream `stream` (counters the draw, which
    counts token ids from 0, never reaches)."""
    c = jnp.uint32(2**31 + 2 * stream)
    return jnp.stack([noise.counter_bits(key, c), noise.counter_bits(key, c + 1)], axis=-1)


def rejection_choice(
    probs: jax.Array,  # [B, V] f32, the final distribution p
    drawn: jax.Array,  # [B] i32, the row's own draw (kept where `valid` is False)
    key: jax.Array,  # [B, 2] u32, the row key at this position
    draft: jax.Array,  # [B] i32
    q: jax.Array | None,  # [B, V] f32, the draft's distribution; None: one-hot at `draft`
    valid: jax.Array,  # [B] bool
    accept_stream: int = 1,
    residual_stream: int = 2,
) -> jax.Array:
    """Speculative sampling at one position: keep `draft` with probability
    min(1, p(d) / q(d)), else draw from max(p - q, 0) renormalised (an exponential race
    on the row's own sub-stream). The token follows p whatever q is."""
    vocab = probs.shape[1]
    d = jnp.clip(draft, 0, vocab - 1)[:, None]
    p_d = jnp.take_along_axis(probs, d, axis=1)[:, 0]
    if q is None:
        q = jax.nn.one_hot(d[:, 0], vocab, dtype=jnp.float32)
    q_d = jnp.take_along_axis(q, d, axis=1)[:, 0]
    bits = noise.counter_bits(sub_key(key, accept_stream), jnp.zeros(draft.shape, jnp.uint32))
    u = bits.astype(jnp.float32) * jnp.float32(2.0**-32)  # [0, 1)
    accept = u * q_d < p_d
    residual = jnp.maximum(probs - q, 0.0)
    e = noise.exponential_from_bits(
        noise.counter_bits(sub_key(key, residual_stream)[:, None, :], jnp.arange(vocab))
    )
    race = jnp.where(residual > 0, jnp.log(residual) - jnp.log(e), NEG_INF)
    resampled = jnp.where(jnp.any(residual > 0, axis=1), jnp.argmax(race, axis=1), drawn)
    return jnp.where(valid, jnp.where(accept, draft, resampled), drawn).astype(jnp.int32)


def kept_distribution(scaled: jax.Array, thr: Thresholds, greedy: jax.Array) -> jax.Array:
    """[B, V] the final distribution given the scaled logits and the thresholds."""
    m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)[:, None]
    w = jnp.where(scaled >= thr.kept[:, None], jnp.exp(scaled - m), 0.0)
    probs = w / jnp.maximum(jnp.sum(w, axis=1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    one_hot = jax.nn.one_hot(jnp.argmax(scaled, axis=1), scaled.shape[1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], one_hot, probs)


@jax.jit
def sampling_distribution(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None = None,
    *,
    processors: tuple | list | None = None,
    states: tuple | None = None,
    allowed_bits: jax.Array | None = None,
) -> jax.Array:
    """[B, V] f32: the exact distribution `sample` draws from (zero outside the kept set).

    Greedy rows are one-hot at their argmax; rows with a non-OK status are all zero.
    `processors`, `states`, `allowed_bits`: as in `sample`.
    """
    name = "ll.sampling_distribution"
    params = check_shapes(name, logits, params, positions, history)
    check_constraint_masks(name, params, allowed_bits)
    params, states = with_processors(name, logits, params, processors, states)
    params = params.device_only()
    positions = jnp.asarray(positions, jnp.int32)
    proc = adjust_logits(
        logits, params, positions, history, states=states, allowed_bits=allowed_bits
    )
    cand_x, _ = candidates(proc.scaled, min(NUM_CANDIDATES, proc.scaled.shape[1]))
    thr = thresholds(proc.scaled, *proc.rules(params.knobs), cand_x)
    probs = kept_distribution(proc.scaled, thr, proc.greedy)
    return jnp.where((proc.status(thr.row_max) == STATUS_OK)[:, None], probs, 0.0)
