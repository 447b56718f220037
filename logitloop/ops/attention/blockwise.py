"""Attention in blocks with an online softmax: no `[T, S]` scores or mask is ever held.

Queries go in blocks of at most Q_BLOCK columns (one after another, `lax.map`); for each,
the keys go in blocks of K_BLOCK slots (`lax.scan`) carrying, per query and head, the
running maximum m of its scores, the running sum l of `exp(score - m)` and the running
weighted sum of values, all float32 (FlashAttention's recurrence). A new block with maximum
m' rescales what came before by `exp(m - m')`. The mask of a block is computed from
positions (`reference.Mask`), and a block no query of the block may see (past the causal
edge, before the window, an empty ring slot) is skipped (`lax.cond`), so a prompt pass
does about half the work of the full product and a short prompt in a long cache only the
work its own slots need.

Temporaries per layer: the scores and probabilities of one (query block, key block) pair,
`B x H x Q_BLOCK x K_BLOCK` float32 each, plus the accumulators and the output, `B x T x H
x D`: linear in T, and independent of the cache length S.

A query that sees no key at all (padding) returns zeros (the reference returns the mean
of the values: neither is ever read). Every other query matches the reference up to the
order of float32 sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.ops.attention.reference import MASK_VALUE, Mask, masked_scores

# Keys per block and queries per block. 512 x 512 float32 scores are 1 MiB per head: big
# enough that each product is a real matrix product, small enough that a long prompt's
# temporaries stay a few MiB per head whatever T and S.
K_BLOCK = 512
Q_BLOCK = 512


def _blocks(length: int, most: int) -> tuple[int, int]:
    """`(size, count)`: the fewest blocks of at most `most` that cover `length`, as even as
    multiples of 8 allow (576 slots: two of 288, not 512 and a second 512 that mostly
    repeats the first)."""
    count = -(-length // most)
    size = -(-length // count)
    if count > 1 and -(-size // 8) * 8 <= most:
        size = -(-size // 8) * 8
    return size, -(-length // size)


def blockwise_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, Hkv, S, D]
    v: jax.Array,  # [B, Hkv, S, D]
    mask: Mask,  # q_pos [B, T]
    scale: float,
    softcap: float | None = None,
    *,
    q_block: int | None = None,
    k_block: int | None = None,
) -> jax.Array:
    """Grouped-query attention of T queries over S keys, block by block; `[B, T, H, D]`.

    Same contract as `reference.reference_attention` with the mask given as positions.
    `q_block`, `k_block`: queries and keys per block (default Q_BLOCK, K_BLOCK).
    """
    b, t, h, d = q.shape
    hkv, slots = k.shape[1], k.shape[2]
    g = h // hkv
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    bk, num_k = _blocks(slots, k_block or K_BLOCK)
    bq, num_q = _blocks(t, q_block or Q_BLOCK)
    pad = num_q * bq - t  # padded queries (position -1) see nothing
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, num_q, bq, hkv, g, d)
    q_pos = jnp.pad(mask.q_pos, ((0, 0), (0, pad)), constant_values=-1).reshape(b, num_q, bq)

    def update(carry, qb, kb, vb, seen):
        # qb [B, Bq, Hkv, G, D], kb/vb [B, Hkv, Bk, D], seen [B, Bq, Bk]
        peak, total, acc = carry  # [B, Hkv, G, Bq], [B, Hkv, G, Bq], [B, Hkv, G, Bq, D] f32
        scores = jnp.einsum("bqkgd,bksd->bkgqs", qb, kb, preferred_element_type=jnp.float32)
        scores = masked_scores(scores, seen[:, None, None], scale, softcap)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - new_peak[..., None])  # [B, Hkv, G, Bq, Bk]
        rescale = jnp.exp(peak - new_peak)
        pv = jnp.einsum(
            "bkgqs,bksd->bkgqd", p.astype(q.dtype), vb, preferred_element_type=jnp.float32
        )
        return new_peak, total * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    def query_block(args):
        qb, qpb = args  # [B, Bq, Hkv, G, D], [B, Bq]

        def key_block(carry, j):
            # The last block is moved back to end at slot S (no padded copy of the cache);
            # the slots it shares with the block before were counted there.
            start = jnp.minimum(j * bk, slots - bk)
            kb = jax.lax.dynamic_slice_in_dim(k, start, bk, axis=2)
            vb = jax.lax.dynamic_slice_in_dim(v, start, bk, axis=2)
            new = (start + jnp.arange(bk) >= j * bk)[None, None, :]  # [1, 1, Bk]
            seen = mask.visible(qpb, mask.key_positions(start, bk)) & new  # [B, Bq, Bk]
            if num_k == 1:
                return update(carry, qb, kb, vb, seen), None
            carry = jax.lax.cond(jnp.any(seen), update, lambda c, *_: c, carry, qb, kb, vb, seen)
            return carry, None

        init = (
            jnp.full((b, hkv, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, hkv, g, bq), jnp.float32),
            jnp.zeros((b, hkv, g, bq, d), jnp.float32),
        )
        (_, total, acc), _ = jax.lax.scan(key_block, init, jnp.arange(num_k))
        # total == 0 only where no key was seen, and acc is 0 there too.
        out = acc / jnp.where(total > 0, total, 1.0)[..., None]
        return out.astype(q.dtype)  # [B, Hkv, G, Bq, D]

    if num_q == 1:
        out = query_block((q[:, 0], q_pos[:, 0]))[None]
    else:
        out = jax.lax.map(query_block, (jnp.moveaxis(q, 1, 0), jnp.moveaxis(q_pos, 1, 0)))
    # [Nq, B, Hkv, G, Bq, D] -> [B, Nq, Bq, Hkv, G, D] -> [B, T, H, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, num_q * bq, h, d)
    return out[:, :t]
