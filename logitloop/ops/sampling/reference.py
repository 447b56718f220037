"""The sort-based reference of the sampling operator: short, obviously correct, slow.

Sorts each row once and reads every threshold off the sorted values, then races the kept
tokens with the same per-token noise as every backend (`noise.py`), so that a backend's
tokens can be compared with these exactly. The shared backend tests
(`tests/ops/test_sampling_backends.py`) hold every implementation to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.ops.sampling.xla import NEG_INF, Draw, Thresholds, race_scores


def thresholds_reference(
    x: jax.Array,  # [B, V] f32, scaled logits; NaN-free
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
) -> Thresholds:
    """top-k: the k-th largest value; top-p: the value at which the cumulative mass of the
    top-k survivors, in descending order, first reaches p of their total; min-p:
    max + log(min_p). A token is kept iff x >= each threshold (ties kept)."""
    vocab = x.shape[1]
    desc = -jnp.sort(-x, axis=1)  # [B, V]
    row_max = desc[:, 0]
    k_on = (top_k > 0) & (top_k < vocab)
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=1)[:, 0]
    t_k = jnp.where(k_on, kth, NEG_INF)
    m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[:, None]
    cum = jnp.cumsum(jnp.where(desc >= t_k[:, None], jnp.exp(desc - m), 0.0), axis=1)
    reach = jnp.sum(cum < (top_p * cum[:, -1])[:, None], axis=1)
    at_p = jnp.take_along_axis(desc, jnp.minimum(reach, vocab - 1)[:, None], axis=1)[:, 0]
    t_p = jnp.where(top_p < 1.0, at_p, NEG_INF)
    t_m = jnp.where(min_p > 0, row_max + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), NEG_INF)
    return Thresholds(row_max=row_max, top_k=t_k, top_p=t_p, min_p=t_m)


def filter_and_sample_reference(
    x: jax.Array,  # [B, V] f32, scaled logits; NaN-free
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
) -> tuple[Draw, Thresholds]:
    """The contract of `filter_and_sample`: greedy rows take the first argmax with
    log-probability 0; other rows race every kept token with the shared noise."""
    thr = thresholds_reference(x, top_k, top_p, min_p)
    m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)[:, None]
    log_w = jnp.where(x >= thr.kept[:, None], x - m, NEG_INF)
    ids = jnp.arange(x.shape[1], dtype=jnp.uint32)[None, :]
    raced = jnp.argmax(race_scores(log_w, key, ids), axis=1)
    tokens = jnp.where(greedy, jnp.argmax(x, axis=1), raced).astype(jnp.int32)
    log_norm = jax.nn.logsumexp(log_w, axis=1)
    x_tok = jnp.take_along_axis(x, tokens[:, None], axis=1)[:, 0]
    logprobs = jnp.where(greedy, 0.0, (x_tok - m[:, 0]) - log_norm)
    return Draw(tokens=tokens, logprobs=logprobs, log_norm=log_norm + m[:, 0]), thr
