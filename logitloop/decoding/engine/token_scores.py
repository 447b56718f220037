"""The scores of given tokens under a model's logits: the device side of `score` and
`ll.token_logprobs` (`trainer`), on `[B, C, V]` logits whatever pass made them.

- `raw_logprobs`: each token's float32 log-softmax, with the sampler's own normalizer.
- `processed_logprobs`: each token's log-probability under its row's processed
  distribution (the sampler's steps 1-7 with the earlier tokens as generated).
- `token_scores`: what `score` returns per token: the raw log-probability, whether the
  token was the argmax, whether its logits were bad, and the top-n alternatives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.decoding.sampling.sampler import STATUS_OK, adjust_logits, raw_normalizer
from logitloop.ops.sampling.noise import row_keys
from logitloop.ops.sampling.xla import filter_and_sample as xla_filter_and_sample
from logitloop.ops.sampling.xla import first_argmax, scale_logits

NEG_INF = float("-inf")


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
            proc.adjusted, *proc.rules(params.knobs), proc.greedy, key,
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


def token_scores(
    logits: jax.Array,  # [B, C, V] f32
    tokens: jax.Array,  # [B, C] i32
    valid: jax.Array,  # [B, C] bool
    num_top: int,
) -> dict[str, jax.Array]:
    """`score`'s values of each token: raw [B, C] (`raw_logprobs`), is_argmax [B, C] (the
    model's argmax, ties to the lowest id), bad [B, C] (the position's logits were bad),
    and with `num_top` top_ids / top_values [B, C, num_top] (the raw alternatives)."""
    batch, width = tokens.shape
    raw, (raw_max, norm, bad) = raw_logprobs(logits, tokens, valid)
    best = first_argmax(logits.reshape(batch * width, -1)).reshape(batch, width)
    out = dict(raw=raw, is_argmax=valid & ~bad & (best == tokens), bad=valid & bad)
    if num_top:
        log_sm = (logits - raw_max[..., None]) - norm[..., None]
        log_sm = jnp.where(bad[..., None], NEG_INF, log_sm)  # no alternatives from bad logits
        vals, ids = jax.lax.top_k(log_sm, min(num_top, logits.shape[2]))
        out["top_ids"], out["top_values"] = ids.astype(jnp.int32), vals
    return out
