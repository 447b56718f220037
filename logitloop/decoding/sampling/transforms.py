"""Pure logits transforms, one function per step of the sampling order.

Every function takes `logits: [B, V]` float32 plus per-row settings with a leading `B` axis
and returns new `[B, V]` float32 logits; none of them reads another row. A row whose
settings make a transform an identity (penalty 1, no ids, ...) is returned bit-for-bit.

Token-id lists are padded with -1; padded slots are mapped to the out-of-range index `V` and
dropped by the scatter (`mode="drop"`), so they cost nothing and change nothing.

The truncation steps (top-k, top-p, min-p) and the draw are in
`logitloop.ops.sampling`: they work on thresholds, not on rewritten logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.decoding.sampling.history import DistinctTokens
from logitloop.ops.sampling.xla import F32_MAX, inverse_temperature

NEG_INF = float("-inf")


def _rows(logits: jax.Array) -> jax.Array:
    return jnp.arange(logits.shape[0])[:, None]  # [B, 1]


def _scatter_index(ids: jax.Array, vocab: int) -> jax.Array:
    """Padded ids (-1) -> `vocab`, which `mode="drop"` scatters ignore."""
    return jnp.where(ids >= 0, ids, vocab)


def allowed_mask(logits: jax.Array, allowed_ids: jax.Array, has_allowed: jax.Array) -> jax.Array:
    """Set every token outside the row's allow-list to -inf.

    logits: [B, V]; allowed_ids: [B, Na] (-1 padded); has_allowed: [B] bool. Rows with
    `has_allowed == False` are unchanged. One elementwise pass writes the new array (the
    scatters of the later steps then update it in place) and the allowed values are put back.
    """
    vocab = logits.shape[1]
    idx = jnp.where(has_allowed[:, None], _scatter_index(allowed_ids, vocab), vocab)
    kept = jnp.take_along_axis(logits, jnp.minimum(idx, vocab - 1), axis=1)  # [B, Na]
    only = jnp.where(has_allowed[:, None], NEG_INF, logits)
    return only.at[_rows(logits), idx].set(kept, mode="drop")


def allowed_bitmask(logits: jax.Array, bits: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
    """Set every token whose bit is clear to -inf (a constraint's mask, step 1).

    logits: [B, V]; bits: [B, W] u32, token v allowed iff bit v % 32 of word v // 32 is set
    (W >= ceil(V / 32); every bit set = unconstrained); offset: the global id of column 0
    (this device's vocabulary slice on a mesh).
    """
    ids = offset + jnp.arange(logits.shape[1])  # [V] global ids
    on = (bits[:, ids >> 5] >> (ids & 31).astype(jnp.uint32)) & jnp.uint32(1)  # [B, V]
    return jnp.where(on.astype(bool), logits, NEG_INF)


def logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Add `bias_values[r, j]` to token `bias_ids[r, j]`. A -inf logit stays -inf.

    logits: [B, V]; bias_ids: [B, Nb] (-1 padded, no repeats within a row); bias_values:
    [B, Nb].
    """
    idx = _scatter_index(bias_ids, logits.shape[1])
    return logits.at[_rows(logits), idx].add(bias_values, mode="drop")


def ban_tokens(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """Set `banned_ids` (per row, -1 padded, [B, Nn]) to -inf."""
    idx = _scatter_index(banned_ids, logits.shape[1])
    return logits.at[_rows(logits), idx].set(NEG_INF, mode="drop")


def suppress_stop_tokens(
    logits: jax.Array, stop_token_ids: jax.Array, positions: jax.Array, min_tokens: jax.Array
) -> jax.Array:
    """`min_tokens`: while `positions < min_tokens`, every stop token id is -inf.

    stop_token_ids: [B, Ns] (-1 padded); positions: [B], the 0-based index of the token being
    drawn among the row's generated tokens; min_tokens: [B].
    """
    hold = (positions < min_tokens)[:, None] & (stop_token_ids >= 0)  # [B, Ns]
    idx = jnp.where(hold, stop_token_ids, logits.shape[1])
    return logits.at[_rows(logits), idx].set(NEG_INF, mode="drop")


def repetition_penalty(logits: jax.Array, seen: DistinctTokens, penalty: jax.Array) -> jax.Array:
    """Penalise every distinct token of the prompt and the generated text once.

    Positive logits are divided by `penalty` ([B]), negative ones multiplied (the CTRL /
    `transformers` rule), saturating at +-F32_MAX. Touches only the row's distinct tokens
    (gather, then scatter).
    """
    vocab = logits.shape[1]
    idx = jnp.where(seen.is_distinct, seen.ids, vocab)  # [B, C]
    vals = jnp.take_along_axis(logits, jnp.minimum(idx, vocab - 1), axis=1)
    p = penalty[:, None]
    new = jnp.where(vals > 0, vals / p, vals * p)
    # An extreme penalty overflows a finite logit: saturate it (a masked -inf stays -inf).
    new = jnp.where(jnp.isinf(vals), vals, jnp.clip(new, -F32_MAX, F32_MAX))
    return logits.at[_rows(logits), idx].set(new, mode="drop")


def presence_frequency_penalty(
    logits: jax.Array, seen: DistinctTokens, presence: jax.Array, frequency: jax.Array
) -> jax.Array:
    """`logit -= frequency * count + presence * (count > 0)` over generated tokens only.

    count is how many times the row generated the token (prompt tokens do not count);
    presence, frequency: [B].
    """
    vocab = logits.shape[1]
    count = seen.generated_count
    touched = seen.is_distinct & (count > 0)
    idx = jnp.where(touched, seen.ids, vocab)  # [B, C]
    delta = frequency[:, None] * count + presence[:, None]
    return logits.at[_rows(logits), idx].add(-delta.astype(logits.dtype), mode="drop")


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Divide by the row's temperature: a product with its float32 reciprocal 1 / T (see
    `logitloop.ops.sampling.xla.scale_logits`). Rows with temperature 0 are greedy and
    unscaled."""
    return logits * inverse_temperature(temperature)[:, None]
