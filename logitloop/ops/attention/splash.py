"""A whole prompt on a TPU through jax's splash attention (a Pallas TPU kernel).

`jax.experimental.pallas.ops.tpu.splash_attention` is the flash attention jax ships for
TPUs: a static block-sparse mask (causal, or causal with a sliding window), segment ids,
logit soft-capping, and a backward pass. It runs one row and one key/value head at a time
(its MQA form: the G query heads of a group against one key head), so the call is mapped
over rows and key/value heads. Which calls it fits, and the rolling of left padding, are
`fused.whole_prompt`'s: the first `lengths[b]` columns of row b are real and get segment 1,
the rest (rolled padding, and the columns added to reach a multiple of 128) segment 0,
so no real query sees them and every padded query sees at least itself.

Imported by `api.attention` when it runs "splash" (Pallas is slow to import).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from logitloop.ops.attention.fused import whole_prompt
from logitloop.ops.attention.reference import Mask

# The kernel's query and key blocks are multiples of the TPU's 128 lanes; the call's
# columns are padded to a multiple of LANES and blocks are the largest of BLOCKS that
# divides them.
LANES = 128
BLOCKS = (512, 256, 128)


def splash_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, Hkv, S, D]
    v: jax.Array,  # [B, Hkv, S, D]
    mask: Mask,
    scale: float,
    softcap: float | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """`attention(..., implementation="splash")`: `[B, T, H, D]`. `interpret=True` runs
    the kernel in Pallas's interpreter (any backend; for tests)."""

    def fused(rolled, keys, values, lengths):
        return _splash(rolled, keys, values, lengths, scale, softcap, mask.window, interpret)

    return whole_prompt(q, k, v, mask, scale, softcap, fused)


def _splash(q, k, v, lengths, scale, softcap, window, interpret):
    # q [B, T, H, D] (row b's first lengths[b] columns real); k, v [B, Hkv, T, D]
    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    tp = -(-t // LANES) * LANES
    block = next(size for size in BLOCKS if tp % size == 0)
    # The kernel takes no scale: scaling q first gives the same scores (soft-capped after).
    q = jnp.pad(q * jnp.asarray(scale, q.dtype), ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    q = q.reshape(b, tp, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, Tp, D]
    k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, tp - t), (0, 0))) for a in (k, v))
    segments = (jnp.arange(tp)[None, :] < lengths[:, None]).astype(jnp.int32)  # [B, Tp]
    shape = (tp, tp)
    head_mask = (
        splash.CausalMask(shape)
        if window is None
        else splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    )
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([head_mask] * g),
        block_sizes=sizes,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )

    def one(q, k, v, seg):  # q [G, Tp, D]; k, v [Tp, D]; seg [Tp]
        return kernel(q, k, v, segment_ids=splash.SegmentIds(seg, seg))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(q, k, v, segments)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)[:, :t]  # [B, T, H, D]
