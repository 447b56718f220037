"""The attention every other implementation is tested against, and the mask they share.

`Mask` describes which cache slots each query may see by positions alone, so an
implementation can compute the `[T, S]` mask a block at a time (`blockwise`) or, where a
dense mask is cheap or required (a decode step, the deterministic fixed-order path, this
reference), build it whole with `Mask.dense`.

`reference_attention` is the one-einsum attention the models ran before blockwise
attention: float32 scores `[B, Hkv, G, T, S]` held whole, a softmax over them, one
weighted sum. Its memory grows as T x S, so it serves decode steps (T = 1), short calls
and tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Masked scores get this instead of -inf: a row with every slot masked (a padded query)
# then softmaxes to a uniform distribution instead of 0/0 = NaN.
MASK_VALUE = float(np.finfo(np.float32).min)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping); identity when `cap` is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


@struct.dataclass
class Mask:
    """Which keys each query may see, as positions: never a `[T, S]` array.

    The query in column t of row b, at position `q = q_pos[b, t]` (-1: padding, sees
    nothing), sees key s when that key holds a position p with `0 <= p <= q` and, with a
    sliding window, `p > q - window`.

    Attributes:
      q_pos: `[B, T]` int, each query's position, -1 for padding.
      k_pos: `[B, S]` int, the position each key holds (-1: none), or None when key slot s
        holds position s (the full cache layout). A sliding-window ring passes its slots'
        positions followed by this call's own (`logitloop.models.layers.ring_keys`).
      window: the sliding window in tokens, or None (static).
    """

    q_pos: jax.Array
    k_pos: jax.Array | None = None
    window: int | None = struct.field(pytree_node=False, default=None)

    def key_positions(self, start, size: int) -> jax.Array:
        """`[B or 1, size]`: the positions held by key slots `start .. start + size - 1`."""
        if self.k_pos is None:
            return (start + jnp.arange(size))[None, :]
        return jax.lax.dynamic_slice_in_dim(self.k_pos, start, size, axis=1)

    def visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """`[B, Tq] x [B or 1, Sk] -> [B, Tq, Sk]` bool: may query t see key s."""
        q = q_pos[:, :, None]
        p = k_pos[:, None, :]
        ok = (p >= 0) & (p <= q)
        if self.window is not None:
            ok = ok & (p > q - self.window)
        return ok

    def dense(self, num_slots: int) -> jax.Array:
        """`[B, T, S]` bool, the whole mask (S = num_slots keys)."""
        return self.visible(self.q_pos, self.key_positions(0, num_slots))


def reference_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, Hkv, S, D]
    v: jax.Array,  # [B, Hkv, S, D]
    mask: jax.Array,  # [B, T, S] bool
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """Grouped-query attention of T queries over S keys in one product; `[B, T, H, D]`.

    Each of the Hkv key/value heads serves H // Hkv consecutive query heads (HF's
    `repeat_kv` layout). Scores and softmax are float32; the weighted sum runs in the
    query dtype. With `softcap`, the scaled scores become `softcap * tanh(score / softcap)`
    before masking (Gemma 2).
    """
    b, t, h, d = q.shape
    hkv = k.shape[1]
    q = q.reshape(b, t, hkv, h // hkv, d)  # [B, T, Hkv, G, D]
    scores = jnp.einsum(
        "btkgd,bksd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32
    )
    scores = masked_scores(scores, mask[:, None, None, :, :], scale, softcap)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v.astype(q.dtype))  # [B, T, Hkv, G, D]
    return out.reshape(b, t, h, d)


def masked_scores(
    scores: jax.Array,  # [B, Hkv, G, T, S] float32 dot products
    mask: jax.Array,  # bool, broadcastable to scores
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """The scores a softmax sees: scaled, soft-capped, `MASK_VALUE` where masked."""
    return jnp.where(mask, soft_cap(scores * scale, softcap), MASK_VALUE)
