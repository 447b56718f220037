"""A fused whole-prompt kernel run on the calls it fits (cuDNN's in `api`, splash's on a
TPU in `splash`), `blockwise_attention` on the others: what both wrappers share, so that
neither imports the other."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.ops.attention.blockwise import blockwise_attention
from logitloop.ops.attention.reference import Mask


def whole_prompt(q, k, v, mask: Mask, scale: float, softcap, fused) -> jax.Array:
    """A fused kernel whose causal mask lets query i see keys 0..i, run on the calls it fits.

    A call in which every row's first real column is at position 0 (a whole prompt over
    the full cache layout) fits once each row's left padding is rolled to the end: its real
    columns are then at the slot of their position. `fused(rolled [B, T, H, D], keys
    [B, Hkv, T, D], values [B, Hkv, T, D], lengths [B] int32)` returns `[B, T, H, D]`, where
    the first `lengths[b]` columns of row b are its real queries and keys. Any other call (a
    later prefill chunk, a verification, a ring, a cache shorter than the call) runs
    `blockwise_attention` (one `lax.cond`).
    """
    b, t, h, d = q.shape
    if mask.k_pos is not None or k.shape[2] < t:
        return blockwise_attention(q, k, v, mask, scale, softcap)
    pad = jnp.sum(mask.q_pos < 0, axis=1)  # [B] left padding
    lengths = (t - pad).astype(jnp.int32)
    first = jnp.take_along_axis(mask.q_pos, jnp.minimum(pad, t - 1)[:, None], axis=1)[:, 0]

    def run(q, k, v):
        cols = jnp.arange(t)[None, :]
        rolled = jnp.take_along_axis(q, ((cols + pad[:, None]) % t)[:, :, None, None], axis=1)
        keys, values = (a[:, :, :t].astype(q.dtype) for a in (k, v))
        out = fused(rolled, keys, values, lengths)
        out = jnp.take_along_axis(out, ((cols - pad[:, None]) % t)[:, :, None, None], axis=1)
        return jnp.where((mask.q_pos >= 0)[:, :, None, None], out, 0).astype(q.dtype)

    def blocks(q, k, v):
        return blockwise_attention(q, k, v, mask, scale, softcap)

    return jax.lax.cond(jnp.all((first == 0) | (lengths == 0)), run, blocks, q, k, v)
