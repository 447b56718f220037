"""`token_logprobs`: the trainer's side of an RL rollout, the sampler's numbers under grad.

An RL trainer (GRPO, PPO, RLOO) needs, for every sampled token, the log-probability the
policy gave it, as a function of the weights it can differentiate. `token_logprobs` is
`score`'s device computation with the weights as an argument: the same prompt pass, the
same pass over the completion (`score_rows.continuation_logits`), the same log-softmax
normalizer and the same processed pipeline (`token_scores.processed_logprobs`, which runs the
sampler's own `adjust_logits` and truncation), compiled with the same numerics policy. So
with `deterministic=True` its values are bit for bit the ones `generate` reported for the
tokens it drew, in float32 and bfloat16 (docs/rl.md, "Exactness").

Index bookkeeping, for one row `[a, b, c, x, y, z, pad]` with prompt length 3 and length
6 (`lengths`, default the row's width T = 7):

    position t      0  1  2  3  4  5  6
    token           a  b  c  x  y  z  pad
    raw_logprobs    0  0  0  lp(x|abc)  lp(y|abcx)  lp(z|abcxy)  0

position t holds token t's value given the tokens before it; prompt positions
(t < prompt_lengths) and padding (t >= lengths) hold 0.0 (so a masked sum needs no
`where`), and their `keep_mask` rows are all False.

Under differentiation the values stay the forward program's: XLA fuses a value-and-grad
program otherwise than the forward alone (on XLA:CPU a float32 `a * b + c` becomes a
fused multiply-add or not by fusion: 61 of 72 tokens differed by up to 4e-6), so the
function is a `custom_vjp` whose forward runs the forward program and whose backward is
the gradient of that same computation, taken in a program of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from logitloop.decoding.engine.host import MIN_PROMPT_BUCKET, bucket, row_bucket
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.engine.score_rows import MIN_CONTINUATION_BUCKET, continuation_logits
from logitloop.decoding.engine.token_scores import processed_logprobs, raw_logprobs
from logitloop.decoding.loop.layout import Layout
from logitloop.decoding.loop.runner import ModelRunner, runner_jit
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.kv import Rows

__all__ = ["RolloutBatch", "TokenLogprobs", "rollout_batch", "token_logprobs"]


@struct.dataclass
class TokenLogprobs:
    """`token_logprobs`' result, aligned with `token_ids` (module docstring: position t is
    token t given the tokens before it; 0.0 / False at prompt and padding positions)."""

    raw_logprobs: jax.Array  # [B, T] f32, log_softmax(model logits)[token]
    logprobs: jax.Array | None = None  # [B, T] f32 under the row's processed distribution
    keep_mask: jax.Array | None = None  # [B, T, V] bool, the tokens that distribution keeps


@dataclasses.dataclass
class RolloutBatch:
    """A rollout's rows laid out as `token_logprobs` takes them (`rollout_batch`): row r is
    prompt r then its completion then padding, and the rollout's values sit at the
    completion's positions (0.0, or -1 for routing, elsewhere)."""

    token_ids: np.ndarray  # [B, T] i32
    prompt_lengths: np.ndarray  # [B] i32
    lengths: np.ndarray  # [B] i32, prompt plus completion tokens
    raw_logprobs: np.ndarray  # [B, T] f32, the rollout's raw log-probs
    logprobs: np.ndarray | None  # [B, T] f32, its processed ones (when it reported them)
    routing: np.ndarray | None  # [B, T, L, k] i32 (`generate(return_routing=True)`)

    @property
    def completion_mask(self) -> np.ndarray:
        """[B, T] bool: the completion's positions."""
        col = np.arange(self.token_ids.shape[1])[None]
        return (col >= self.prompt_lengths[:, None]) & (col < self.lengths[:, None])


def rollout_batch(result: Any, width: int | None = None) -> RolloutBatch:
    """`generate`'s result (`GenerationResult`: `prompt_token_ids`, `token_ids`,
    `raw_logprobs`, `logprobs`, `routing`) as the `[B, T]` arrays `token_logprobs` takes,
    T = `width` (at least the longest row; default the longest row: a fixed width keeps
    `token_logprobs` to one compiled program across steps)."""
    rows = [list(p) + list(t) for p, t in zip(result.prompt_token_ids, result.token_ids,
                                              strict=True)]  # fmt: skip
    longest = max(map(len, rows))
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width={width}: the longest row has {longest} tokens")
    batch = len(rows)
    ids = np.zeros((batch, width), np.int32)
    raw = np.zeros((batch, width), np.float32)
    processed = None if result.logprobs is None else np.zeros((batch, width), np.float32)
    routing = None
    if result.routing is not None:
        routing = np.full((batch, width, *result.routing[0].shape[1:]), -1, np.int32)
    plen = np.array([len(p) for p in result.prompt_token_ids], np.int32)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
        raw[r, plen[r] : len(row)] = result.raw_logprobs[r]
        if processed is not None:
            processed[r, plen[r] : len(row)] = result.logprobs[r]
        if routing is not None:
            routing[r, : len(row)] = result.routing[r]
    lengths = np.array(list(map(len, rows)), np.int32)
    return RolloutBatch(ids, plen, lengths, raw, processed, routing)


def token_logprobs(
    model: Any,
    token_ids: Any,  # [B, T] int: each row's prompt, then its completion, then padding
    prompt_lengths: Any,  # [B] int, 1..T
    params: SamplingParams | None = None,
    *,
    lengths: Any = None,  # [B] int, prompt_lengths..T; default T
    deterministic: bool | str = True,
    keep_mask: bool = False,
    routing: Any = None,  # [B, T, L, k] int: experts to replay (a mixture of experts)
    adapters: Any = None,  # an ll.Adapters (LoRA), its table differentiable
    adapter: Any = None,  # each row's adapter name (or None: the base), or one for all
) -> TokenLogprobs:
    """Each completion token's log-probability under `model`, pure and differentiable
    with respect to the model's weights (`nnx.grad`, `jax.grad` of a function of the
    weights, `nnx.value_and_grad`), usable inside `jax.jit` / `nnx.jit`.

    token_ids: `[B, T]` rows of prompt, completion and padding (padding's ids are not
    read by any real position; any id in the vocabulary). prompt_lengths: `[B]`, each at
    least 1 and at most the row's length. lengths: `[B]` prompt plus completion tokens per
    row (default: T). Returns `TokenLogprobs` (`[B, T]`, module docstring):

    - `raw_logprobs`: the float32 log-softmax of the logits (as `generate` and `score`
      report `raw_logprobs`);
    - `logprobs` (with `params`, one row per row of `token_ids`): under the row's
      processed distribution, the sampler's own steps 1-7 (temperature, top-k, top-p,
      min-p, bias, penalties and processors with the history as it was at that
      position), -inf where a filter removed the token, as `score` computes it. The
      model's EOS ids join every row's stop ids, as in `score`. Rows sampled with
      `generate(..., n=k)` are `params.samples(k)`'s rows (their seeds decide which token
      the pipeline's own draw picks, whose value is the sampler's bit for bit);
    - `keep_mask` (`keep_mask=True`): `[B, T, V]` bool, the tokens that distribution
      keeps at each position (a greedy row: its argmax), to replay the filters.

    `deterministic=True` (the default here, unlike `generate`): the values are bit for
    bit those `generate(..., deterministic=True)` and `score(..., deterministic=True)`
    report for the same tokens, in float32 and bfloat16, and stay so under
    differentiation (a `custom_vjp`: the forward program's values, the backward of the
    same computation). Inside your own `jax.jit` the computation is traced into your
    program and compiled with your program's options: compile it with
    `logitloop.models.fixed_order.compiler_options()` to keep bfloat16 exact there.
    New weights of the same structure (`nnx.update`) compile nothing, nor does a concrete
    call whose `B` and `T` fall in the buckets of an earlier one (the rows padded to a
    power of two, `T` to `bucket(T, MIN_CONTINUATION_BUCKET)`, the results cut back on the
    host: `_padded`, `_cut`).

    `routing` (a mixture of experts, routing replay): `[B, T, L, k]` int, aligned with
    `token_ids`, for each token the k experts each of the model's L routed layers is to
    send it to, as `generate(..., return_routing=True)` records them
    (`result.routing[i]` for row `prompt_token_ids[i] + token_ids[i]`); a token whose
    first id is -1 (padding, the last generated token) is routed by the router. Each
    replayed token's mixture weights are the router's current probabilities of those
    experts, renormalized as the model does, so gradients reach the router.

    `adapters`, `adapter` (LoRA, docs/lora.md): each row under its adapter, as in
    `generate`. The table is differentiable: `jax.grad(lambda t: loss(token_logprobs(...,
    adapters=dataclasses.replace(adapters, table=t))))(adapters.table)` gives the
    gradient with respect to every adapter's A and B (the base weights get none).
    """
    options = Options(deterministic=deterministic, adapters=adapters, adapter=adapter)
    job = plan(model, options, adapters=True)
    info = job.info
    if keep_mask and params is None:
        raise ValueError("keep_mask is the processed distribution's: pass params with it")
    ids, prompt_len, lengths = _checked_rows(token_ids, prompt_lengths, lengths, info.vocab_size)
    if params is not None:
        params = _checked_params(params, ids.shape[0], info)
    if routing is not None:
        routing = _checked_routing(routing, ids.shape, info)
    slots = None if adapters is None else adapters.slots(adapter, ids.shape[0], "adapter")
    inputs = _Inputs(ids, prompt_len, lengths, params, routing, slots)
    shape = ids.shape
    # The differentiable weights: the model's, or with adapters only the table (the base
    # then enters as a constant: its gradient is not computed).
    weights = info.weights if adapters is None else (info.weights, adapters.table)
    concrete = not _is_traced((inputs, weights))
    if concrete:  # bucketed rows and width: one program per bucket, not per shape
        inputs = _padded(inputs)
        ids, plen, total, routes, slots = jax.device_put(
            (inputs.token_ids, inputs.prompt_lengths, inputs.lengths, inputs.routing, inputs.slots)
        )
        inputs = inputs.replace(
            token_ids=ids, prompt_lengths=plen, lengths=total, routing=routes, slots=slots
        )
    raw, processed = _exact(info.runner, job.layout, weights, inputs)
    keep = None
    if keep_mask:
        no_grad = jax.lax.stop_gradient(weights)
        keep = _program(info.runner, no_grad, inputs, keep_mask=True, layout=job.layout)[2]
    out = TokenLogprobs(raw, None if params is None else processed, keep)
    return _cut(out, shape) if concrete else out


# ----------------------------------------------------------------------------- host side


def _is_traced(x: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def _checked_rows(token_ids, prompt_lengths, lengths, vocab_size: int):
    """int32 arrays, their shapes checked, and their values when they are concrete (inside
    a trace only the shapes can be). Concrete rows stay NumPy arrays (an eager `jnp` op
    would compile a program per new shape); traced ones are `jnp` arrays."""
    traced = _is_traced((token_ids, prompt_lengths, lengths))
    xp = jnp if traced else np
    ids = xp.asarray(token_ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError(
            f"token_ids must be a [B, T] array of token ids with B >= 1 and T >= 2 (a prompt "
            f"token and a completion token), got shape {tuple(ids.shape)}"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    batch, width = ids.shape
    plen = xp.asarray(prompt_lengths)
    total = xp.full((batch,), width, np.int32) if lengths is None else xp.asarray(lengths)
    for name, value in (("prompt_lengths", plen), ("lengths", total)):
        if value.shape != (batch,) or not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be {batch} integers (one per row of token_ids), got "
                f"shape {tuple(value.shape)} of {value.dtype}"
            )
    if not traced:
        for r in range(batch):
            if not 1 <= total[r] <= width:
                raise ValueError(
                    f"lengths[{r}] = {total[r]} is outside the allowed range [1, {width}] "
                    "(the width of token_ids)"
                )
            if not 1 <= plen[r] <= total[r]:
                raise ValueError(
                    f"prompt_lengths[{r}] = {plen[r]} is outside the allowed range "
                    f"[1, {total[r]}] (a prompt token at least, at most the row's length)"
                )
            row = ids[r, : total[r]]
            bad = np.flatnonzero((row < 0) | (row >= vocab_size))
            if bad.size:
                raise ValueError(
                    f"token_ids[{r}, {bad[0]}] = {row[bad[0]]} is outside the vocabulary "
                    f"[0, {vocab_size})"
                )
    return ids.astype(np.int32), plen.astype(np.int32), total.astype(np.int32)


def _padded(inputs: _Inputs) -> _Inputs:
    """Concrete rows padded to their buckets (NumPy; the caller moves them): the rows to
    `host.row_bucket` (as `generate`'s), the width to `bucket(T, MIN_CONTINUATION_BUCKET)`,
    widths `_forward` pads its passes to anyway, so a padded call runs the same passes and
    its real rows keep their values (with `deterministic=True` bit for bit: a row's values
    do not depend on the other rows). A padding row is one prompt token and nothing to
    score, with row 0's params (`SamplingParams.with_dummy_rows`)."""
    batch, width = inputs.token_ids.shape
    rows, cols = row_bucket(batch), bucket(width, MIN_CONTINUATION_BUCKET)
    if (rows, cols) == (batch, width):
        return inputs

    def pad(x, fill):
        x = np.asarray(x)
        shape = (rows, cols)[: x.ndim] + x.shape[2:]
        out = np.full(shape, fill, x.dtype)
        out[tuple(slice(n) for n in x.shape)] = x
        return out

    params = None if inputs.params is None else inputs.params.with_dummy_rows(rows)
    return _Inputs(
        token_ids=pad(inputs.token_ids, 0),
        prompt_lengths=pad(inputs.prompt_lengths, 1),
        lengths=pad(inputs.lengths, 1),
        params=params,
        routing=None if inputs.routing is None else pad(inputs.routing, -1),
        slots=None if inputs.slots is None else pad(inputs.slots, -1),
    )


def _cut(out: TokenLogprobs, shape: tuple[int, int]) -> TokenLogprobs:
    """A padded call's results cut back to the caller's `[B, T]`, on the host (an eager
    slice of a device array would compile a program per shape) and moved back in one
    `device_put`; results already `[B, T]` are returned as they are."""
    if out.raw_logprobs.shape == shape:
        return out
    rows, cols = shape
    host = jax.device_get(out)
    return jax.device_put(jax.tree.map(lambda x: np.asarray(x)[:rows, :cols], host))


def _checked_routing(routing: Any, shape: tuple[int, int], info) -> jax.Array:
    """int32 `[B, T, L, k]` expert ids of this model's routed layers, -1 or in range."""
    routes = info.runner.routing_shape(info.weights)
    if routes is None:
        raise ValueError(
            "routing is a mixture of experts' record (generate(..., return_routing=True)); "
            "this model has no routed layers"
        )
    routing = jnp.asarray(routing) if _is_traced(routing) else np.asarray(routing)
    want = (*shape, *routes)
    if routing.shape != want or not jnp.issubdtype(routing.dtype, jnp.integer):
        raise ValueError(
            f"routing must be an integer array of shape {want} ([B, T] as token_ids, "
            f"{routes[0]} routed layers, {routes[1]} experts per token), got shape "
            f"{tuple(routing.shape)} of {routing.dtype}"
        )
    if not _is_traced(routing):
        num_experts = nnx.merge(info.runner.graphdef, info.weights).config.num_experts
        host = np.asarray(routing)
        bad = np.argwhere((host < -1) | (host >= num_experts))
        if bad.size:
            at = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"routing{list(at)} = {host[at]} is outside the allowed range "
                f"[-1, {num_experts}) (an expert id of this model, or -1)"
            )
    return routing.astype(np.int32)


def _checked_params(params: SamplingParams, batch: int, info) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params)!r}")
    if params.batch_size != batch:
        raise ValueError(
            f"params has batch_size {params.batch_size} but token_ids has {batch} rows: "
            "one row of params per row"
        )
    if params.constraints:
        raise ValueError(
            "params has constraints (structured output): token_logprobs does not replay "
            "automata; score them with ll.score"
        )
    params.check_vocab(info.vocab_size)
    if info.eos_token_ids:
        params = params.with_stop_token_ids(info.eos_token_ids)
    return params.device_only()


# ----------------------------------------------------------------------------- device side


@struct.dataclass
class _Inputs:
    """What the log-probs are of (nothing here is differentiated)."""

    token_ids: jax.Array  # [B, T] i32
    prompt_lengths: jax.Array  # [B] i32
    lengths: jax.Array  # [B] i32
    params: SamplingParams | None
    routing: jax.Array | None = None  # [B, T, L, k] i32, experts to replay
    slots: jax.Array | None = None  # [B] i32, each row's adapter slot (-1: the base)


def _rows_at(x: jax.Array, index: jax.Array, ok: jax.Array, fill) -> jax.Array:
    """`x[b, index[b, j]]` where `ok`, else `fill`: `[B, W] -> [B, J]`."""
    got = jnp.take_along_axis(x, jnp.clip(index, 0, x.shape[1] - 1), axis=1)
    return jnp.where(ok, got, fill)


def _forward(
    runner: ModelRunner,
    weights: Any,
    inputs: _Inputs,
    keep_mask: bool,
    layout: Layout,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """raw [B, T], processed [B, T] (zeros without params) and the keep mask [B, T, V]
    (or None): `score_batch`'s computation, the rows laid out as `score` lays them.
    `weights`: the model's, or `(the model's, an adapter table)` with `inputs.slots`."""
    rows = None
    if inputs.slots is not None:
        base, table = weights
        weights, rows = jax.lax.stop_gradient(base), Rows(inputs.slots, table)
    ids, plen, total = inputs.token_ids, inputs.prompt_lengths, inputs.lengths
    batch, width = ids.shape
    # The prompt left-padded to P columns (its last token in the last column), the
    # completion right-padded to C, as `score_rows.score_row_batch` buckets them.
    p_width = bucket(width, MIN_PROMPT_BUCKET)
    c_width = bucket(width, MIN_CONTINUATION_BUCKET)
    col = jnp.arange(p_width)[None, :]  # [1, P]
    src = col - (p_width - plen[:, None])  # the prompt token in column c
    prompt = _rows_at(ids, src, src >= 0, 0)
    positions = jnp.where(src >= 0, src, -1).astype(jnp.int32)
    at = plen[:, None] + jnp.arange(c_width)[None, :]  # [B, C] the completion's tokens
    cont_len = total - plen
    valid = jnp.arange(c_width)[None, :] < cont_len[:, None]
    cont = _rows_at(ids, at, valid, 0)
    cache_len = p_width + bucket(c_width, MIN_PROMPT_BUCKET)
    hist_col = jnp.arange(cache_len)[None, :]
    history = History(_rows_at(ids, hist_col, hist_col < plen[:, None], -1), plen, plen)
    params = inputs.params
    routing = None
    if inputs.routing is not None:  # the experts to replay, in the same columns as the tokens
        routing = (
            _rows_at(inputs.routing, src[..., None, None], (src >= 0)[..., None, None], -1),
            _rows_at(inputs.routing, at[..., None, None], valid[..., None, None], -1),
        )
    logits = continuation_logits(
        runner,
        weights,
        prompt,
        positions,
        plen,
        cont,
        cont_len,
        cache_len,
        layout,
        routing,
        rows=rows,
    )  # [B, C, V]
    raw, _ = raw_logprobs(logits, cont, valid)
    processed = keep = None
    if params is not None:
        processed, keep = processed_logprobs(
            logits, cont, valid, params, history, keep_mask=keep_mask
        )
    # Back to token_ids' columns: position t is completion token t - prompt_lengths.
    t = jnp.arange(width)[None, :]
    j = t - plen[:, None]  # [B, T]
    real = (j >= 0) & (t < total[:, None])
    raw = _rows_at(raw, j, real, 0.0)
    processed = jnp.zeros_like(raw) if processed is None else _rows_at(processed, j, real, 0.0)
    if keep is not None:
        k = jnp.take_along_axis(keep, jnp.clip(j, 0, c_width - 1)[..., None], axis=1)
        keep = k & real[..., None]
    return raw, processed, keep


_program = runner_jit(_forward, static_argnames=("runner", "keep_mask", "layout"))


def _values(runner: ModelRunner, weights: Any, inputs: _Inputs, layout: Layout):
    raw, processed, _ = _program(runner, weights, inputs, keep_mask=False, layout=layout)
    return raw, processed


def _backward(runner: ModelRunner, weights: Any, inputs: _Inputs, cotangents, layout: Layout):
    """The gradient with respect to the weights of `_forward`'s (raw, processed), for the
    given output cotangents: the same computation, differentiated."""

    def values(w):
        raw, processed, _ = _forward(runner, w, inputs, False, layout)
        return raw, processed

    _, vjp = jax.vjp(values, weights)
    return vjp(cotangents)[0]


_backward_program = runner_jit(_backward, static_argnames=("runner", "layout"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exact(runner: ModelRunner, layout: Layout, weights: Any, inputs: _Inputs):
    return _values(runner, weights, inputs, layout)


def _exact_fwd(runner, layout, weights, inputs):
    return _values(runner, weights, inputs, layout), (weights, inputs)


def _exact_bwd(runner, layout, residuals, cotangents):
    weights, inputs = residuals
    grads = _backward_program(runner, weights, inputs, cotangents, layout=layout)
    return grads, None


_exact.defvjp(_exact_fwd, _exact_bwd)
