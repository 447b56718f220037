"""Sort-free truncation and draw in plain JAX (the XLA path, and the reference for kernels).

Input is the temperature-scaled logits `x: [B, V]` float32 (masks, bias and penalties already
applied). Every truncation rule keeps an upper set of `x`, so the kept set is
`x >= threshold` for one per-row threshold:

  top-k   t_k = the k-th largest x (ties with it kept)
  top-p   t_p = the largest value v with mass(x >= v, x >= t_k) >= p * mass(x >= t_k)
  min-p   t_m = max(x) + log(min_p)
  kept    x >= max(t_k, t_p, t_m)

Nothing sorts the vocabulary. The thresholds come from the row's `C` largest entries
(`lax.top_k`, C = `num_candidates`), which settle them whenever they fall inside that
candidate set; a row that needs more (top_k > C, or a nucleus wider than C tokens) finds
its threshold by bisection over the 32-bit order of float32 values, one counting pass per
bit, run only when some row needs it (`lax.cond`). The draw is an exponential race
(`noise.py`) whose noise is a function of (row key, token id) only: it runs among the
candidates when the kept set lies inside them and over the whole vocabulary otherwise, and
both pick the same token, as does any other backend or any vocabulary sharding that uses
the same noise. A row's token never depends on the rest of the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.ops.sampling import noise

NUM_CANDIDATES = 64
NEG_INF = float("-inf")


@struct.dataclass
class Thresholds:
    """Per-row truncation thresholds in the space of the scaled logits (all [B] f32)."""

    row_max: jax.Array  # max(x); -inf when every token is masked
    top_k: jax.Array  # -inf when top-k is off
    top_p: jax.Array  # -inf when top-p is off
    min_p: jax.Array  # -inf when min-p is off

    @property
    def kept(self) -> jax.Array:
        """[B] the combined threshold: a token is kept iff x >= kept."""
        return jnp.maximum(jnp.maximum(self.top_k, self.top_p), self.min_p)


@struct.dataclass
class Draw:
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log-probability under the final distribution
    log_norm: jax.Array  # [B] f32, final prob of any kept token i = exp(x_i - log_norm)


def sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the float order (NaN-free input)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    flipped = jnp.where(i < 0, ~i, i | jnp.int32(-(2**31)))
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of `sortable_key`."""
    i = jax.lax.bitcast_convert_type(key, jnp.int32)
    bits = jnp.where(i < 0, i & jnp.int32(2**31 - 1), ~i)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def largest_threshold(stat_fn, x: jax.Array, target: jax.Array) -> jax.Array:
    """Largest value v among x with stat_fn(x >= v) >= target, per row, by bisection.

    stat_fn(mask [B, V] bool) -> [B] must be non-decreasing in the mask (a count or a mass
    of non-negative weights). x: [B, V] NaN-free; target: [B]. 32 passes over `x`. Rows where
    even the whole row misses the target get the row's minimum value.
    """
    keys = sortable_key(x)  # [B, V] u32

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + ((hi - lo) >> 1) + ((hi - lo) & 1)  # ceil midpoint without overflow
        ok = stat_fn(keys >= mid[:, None]) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.min(keys, axis=1)
    hi = jnp.max(keys, axis=1)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return key_to_float(lo)


def thresholds(
    x: jax.Array,  # [B, V] f32
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    cand_x: jax.Array,  # [B, C] f32, the C largest x per row, descending
) -> Thresholds:
    """The per-row thresholds of top-k, top-p (over the top-k survivors) and min-p."""
    vocab = x.shape[1]
    c = cand_x.shape[1]
    row_max = cand_x[:, 0]
    last_cand = cand_x[:, -1]

    # top-k: read off the candidates, or bisect on counts when k exceeds them.
    k_on = (top_k > 0) & (top_k < vocab)
    k_in_cand = k_on & (top_k <= c)
    t_k_cand = jnp.take_along_axis(cand_x, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=1)[:, 0]
    k_far = k_on & ~k_in_cand
    t_k_far = jax.lax.cond(
        jnp.any(k_far),
        lambda: largest_threshold(
            lambda m: jnp.sum(m, axis=1, dtype=jnp.int32), x, jnp.where(k_far, top_k, 1)
        ),
        lambda: jnp.full_like(row_max, NEG_INF),
    )
    t_k = jnp.where(k_in_cand, t_k_cand, jnp.where(k_far, t_k_far, NEG_INF))

    # top-p on the distribution renormalised over the top-k survivors.
    p_on = top_p < 1.0
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[:, None]
    survivors = x >= t_k[:, None]
    weights = jnp.where(survivors, jnp.exp(x - safe_max), 0.0)  # [B, V]
    target = top_p * jnp.sum(weights, axis=1)  # [B]
    cand_w = jnp.where(cand_x >= t_k[:, None], jnp.exp(cand_x - safe_max), 0.0)  # [B, C]
    cum = jnp.cumsum(cand_w, axis=1)
    reach = jnp.sum(cum < target[:, None], axis=1)  # index of the first candidate reaching p
    p_in_cand = p_on & (reach < c)
    t_p_cand = jnp.take_along_axis(cand_x, jnp.minimum(reach, c - 1)[:, None], axis=1)[:, 0]
    p_far = p_on & ~p_in_cand
    t_p_far = jax.lax.cond(
        jnp.any(p_far),
        lambda: largest_threshold(
            lambda m: jnp.sum(jnp.where(m, weights, 0.0), axis=1), x, jnp.where(p_far, target, 0.0)
        ),
        lambda: jnp.full_like(row_max, NEG_INF),
    )
    t_p = jnp.where(p_in_cand, t_p_cand, jnp.where(p_far, t_p_far, NEG_INF))
    del last_cand

    t_m = jnp.where(min_p > 0, row_max + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), NEG_INF)
    return Thresholds(row_max=row_max, top_k=t_k, top_p=t_p, min_p=t_m)


def race_scores(log_w: jax.Array, key: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Exponential-race scores `log w - log E(key, token)`; -inf weights never win.

    log_w: [B, N] log-weights of the tokens `token_ids` ([B, N] or [1, N]); key: [B, 2].
    The noise depends only on (row key, token id), so any subset of the vocabulary that
    contains the winner picks the same winner.
    """
    e = noise.exponential_from_bits(noise.counter_bits(key[:, None, :], token_ids))
    return jnp.where(log_w > NEG_INF, log_w - jnp.log(e), NEG_INF)


def draw(
    x: jax.Array,  # [B, V] f32
    thr: Thresholds,
    cand_x: jax.Array,  # [B, C] f32
    cand_i: jax.Array,  # [B, C] i32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
) -> Draw:
    """Draw one token per row from softmax(x) restricted to x >= thr.kept.

    The race among the candidates and the race over the whole vocabulary use the same
    per-token noise, so they pick the same token whenever the kept set lies inside the
    candidates; the whole-vocabulary race runs only for rows whose kept set does not.
    """
    batch, vocab = x.shape
    c = cand_x.shape[1]
    t = thr.kept[:, None]  # [B, 1]
    m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)[:, None]
    inside = (thr.kept > cand_x[:, -1]) | (c == vocab)  # kept set within the candidates

    cand_log_w = jnp.where(cand_x >= t, cand_x - m, NEG_INF)  # [B, C]
    pick = jnp.argmax(race_scores(cand_log_w, key, cand_i.astype(jnp.uint32)), axis=1)
    cand_tok = jnp.take_along_axis(cand_i, pick[:, None], axis=1)[:, 0]
    cand_norm = jax.nn.logsumexp(cand_log_w, axis=1) + m[:, 0]

    def whole_vocab(_):
        log_w = jnp.where(x >= t, x - m, NEG_INF)  # [B, V]
        ids = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
        tok = jnp.argmax(race_scores(log_w, key, ids), axis=1)
        return tok.astype(jnp.int32), jax.nn.logsumexp(log_w, axis=1) + m[:, 0]

    far_tok, far_norm = jax.lax.cond(
        jnp.any(~inside & ~greedy),
        whole_vocab,
        lambda _: (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32)),
        None,
    )
    tokens = jnp.where(greedy, cand_i[:, 0], jnp.where(inside, cand_tok, far_tok))
    log_norm = jnp.where(inside, cand_norm, far_norm)
    x_tok = jnp.take_along_axis(x, tokens[:, None], axis=1)[:, 0]
    logprobs = jnp.where(greedy, 0.0, x_tok - log_norm)
    return Draw(tokens=tokens.astype(jnp.int32), logprobs=logprobs, log_norm=log_norm)


def filter_and_sample(
    x: jax.Array,  # [B, V] f32, scaled logits; NaN-free
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
    *,
    num_candidates: int = NUM_CANDIDATES,
) -> tuple[Draw, Thresholds]:
    """Truncate each row by its own top-k/top-p/min-p and draw one token (XLA path)."""
    c = min(num_candidates, x.shape[1])
    cand_x, cand_i = jax.lax.top_k(x, c)  # [B, C], ties in index order
    thr = thresholds(x, top_k, top_p, min_p, cand_x)
    return draw(x, thr, cand_x, cand_i.astype(jnp.int32), greedy, key), thr
