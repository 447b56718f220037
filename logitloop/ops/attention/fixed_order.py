"""Attention with every sum in a fixed order: the "fixed-order" implementation that the
deterministic modes run (`logitloop.models.fixed_order` says what those modes fix and why).

Each score is the float32 products of one query and one key summed by halving over the
head dimension (`tree_sum`'s order, written as `pairwise_sum` of the per-entry products so
that no `[.., T, 16, D]` product array is written out: elementwise adds, an order fixed by
head_dim; as an einsum the order changed with the batch for head_dim 8), and the sums over
cache slots run in chunks of `SLOT_CHUNK` slots at fixed absolute boundaries (slot 0, 16,
32, ...), each chunk by halving, the chunks then added one after another from slot 0 up (a
loop over the chunks, one chunk per iteration: the loop also keeps XLA:CPU from fusing
RoPE's sin and cos into the broadcast products and recomputing them per slot, which made
a prompt pass 3-4x slower). The loops stop after the last chunk any query of the call may
see (read from the mask): the chunks after it add exact zeros. Slots a row may not see
add exact zeros (exp of the mask value), so slots past a row's last position, padding of
the cache to a multiple of the chunk, a longer bucket or buffer, or a longer prefix of the
cache read by a decode step leave the sums unchanged. The maximum is exact in any order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# Cache slots per attention chunk (a divisor of every cache length `generate`
# allocates: prompt and buffer buckets are multiples of 16).
SLOT_CHUNK = 16


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """The sum over `axis` by halving: entry i is added to entry i + n/2 (an odd length
    gains a zero) until one is left. Only elementwise adds of slices, whose order is fixed
    by the axis length alone; XLA's reduce, by contrast, changes its order with the size of
    the whole array (on XLA:CPU a row of 256 sums differently once there are 16 rows)."""
    # Halved in place, not moved to the last axis first: the same adds of the same
    # entries, without a transpose of x (the attention's [.., slots, head_dim] products
    # summed over the slots were copied out whole, per chunk, to move the slots last).
    axis = axis % x.ndim
    while x.shape[axis] > 1:
        if x.shape[axis] % 2:
            zero = jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))
            x = jnp.concatenate([x, zero], axis=axis)
        half = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(
            x, half, 2 * half, axis=axis
        )
    return jnp.squeeze(x, axis)


def pairwise_sum(terms: list[jax.Array]) -> jax.Array:
    """The sum of same-shaped arrays in `tree_sum`'s order (term i added to term i + n/2,
    an odd count gaining a zero, until one is left): `tree_sum(jnp.stack(terms, a), a)`
    bit for bit, without the stacked array."""
    while len(terms) > 1:
        if len(terms) % 2:
            terms = [*terms, jnp.zeros_like(terms[0])]
        half = len(terms) // 2
        terms = [terms[i] + terms[i + half] for i in range(half)]
    return terms[0]


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """The sum over `axis`, added one entry after another from index 0 (a chain of adds,
    which XLA does not reassociate): trailing exact zeros do not change it."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def fixed_order_attention(
    q: jax.Array,  # [B, T, Hkv, G, D]
    k: jax.Array,  # [B, Hkv, S, D], q's dtype
    v: jax.Array,  # [B, Hkv, S, D], q's dtype
    mask: jax.Array,  # [B, T, S] bool
    masked_scores: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """Softmax attention with every sum in a fixed order; returns `[B, T, Hkv, G, D]`.

    `masked_scores(scores, mask)` maps the raw float32 dot products `[B, Hkv, G, T, S]`
    and the `[B, 1, 1, T, S]` mask to the scores the softmax sees (scale, soft-cap, mask
    value), as `layers` does for the plain path. Products and sums run in float32; the
    probabilities are cast to the query dtype before they weight the values, like the
    plain path's.
    """
    b, t, hkv, g, d = q.shape
    pad = -k.shape[2] % SLOT_CHUNK
    if pad:  # masked slots: exact zeros in every sum
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    chunks = k.shape[2] // SLOT_CHUNK
    q32 = q.astype(jnp.float32).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]

    def by_chunk(a):  # [B, Hkv, S, ...] -> [C, B, Hkv, SLOT_CHUNK, ...]
        a = a.reshape(b, hkv, chunks, SLOT_CHUNK, *a.shape[3:])
        return jnp.moveaxis(a, 2, 0)

    # One chunk of slots per loop iteration: the loop keeps XLA:CPU from fusing the
    # producers of q (RoPE's sin and cos) and of the probabilities (an exp) into the
    # broadcast products and recomputing them for every slot or head element.
    def chunk_scores(kc):  # [B, Hkv, 16, D] -> [B, Hkv, G, T, 16]
        # [B, Hkv, G, T, 1] * [B, Hkv, 1, 1, 16] for each of the D entries, added as
        # `tree_sum` over D adds them (one fixed size), the products fused into the adds
        k32 = kc.astype(jnp.float32)
        return pairwise_sum([q32[..., e, None] * k32[:, :, None, None, :, e] for e in range(d)])

    # Chunks past the last one any query may see (the cache's bucket and buffer beyond
    # the longest row: a third of the slots at lm-eval's lengths) add exact zeros, so
    # their products are skipped: a `lax.cond` per chunk on the live-chunk count read
    # from the mask. The chunks summed, and their order, are those of the full loop, bit
    # for bit. (A loop of the live count alone would be a `while_loop` with a dynamic
    # trip count, which reverse-mode differentiation, `ll.token_logprobs`' backward,
    # cannot take.)
    live = jnp.any(mask.reshape(b, t, chunks, SLOT_CHUNK), axis=(0, 1, 3))  # [C]
    live_chunks = jnp.max(jnp.where(live, jnp.arange(1, chunks + 1), 0))
    index = jnp.arange(chunks)
    score_shape = (b, hkv, g, t, SLOT_CHUNK)

    def live_scores(ikc):  # raw scores of chunk i; a dead chunk's stay 0, which
        i, kc = ikc  # `masked_scores` turns into the mask value
        return jax.lax.cond(
            i < live_chunks, chunk_scores, lambda _: jnp.zeros(score_shape, jnp.float32), kc
        )

    scores = jax.lax.map(live_scores, (index, by_chunk(k)))  # [C, B, Hkv, G, T, 16]
    scores = jnp.moveaxis(scores, 0, 4).reshape(b, hkv, g, t, chunks * SLOT_CHUNK)
    scores = masked_scores(scores, mask[:, None, None, :, :])  # [B, Hkv, G, T, S]
    peak = jnp.max(scores, axis=-1, keepdims=True)  # exact in any order
    exp = jnp.exp(scores - peak).reshape(b, hkv, g, t, chunks, SLOT_CHUNK)
    total = ordered_sum(tree_sum(exp), axis=-1)  # [B, Hkv, G, T]
    probs = (exp / total[..., None, None]).astype(q.dtype)

    def chunk_sum(pv):
        p, vc = pv  # [B, Hkv, G, T, 16], [B, Hkv, 16, D]
        # [B, Hkv, G, T, 16, 1] * [B, Hkv, 1, 1, 16, D] summed over the chunk's slots
        # as a list of the slots' products, added pairwise as `tree_sum` adds them: each
        # product then has one consumer and fuses into the adds, where the whole
        # `[.., T, 16, D]` product array was written out and read back per chunk.
        p32, v32 = p.astype(jnp.float32), vc.astype(jnp.float32)
        terms = [p32[..., s, None] * v32[:, :, None, None, s] for s in range(SLOT_CHUNK)]
        return pairwise_sum(terms)

    zero = jnp.zeros((b, hkv, g, t, d), jnp.float32)

    def add_chunk(acc, ipv):  # chunk after chunk from slot 0: acc + this chunk's sum
        # A dead chunk's part is exact zeros (its probabilities are), so skipping it
        # leaves every sum as the full loop's (a query that sees no key at all, a padding
        # column never read, is the exception: its uniform weights lose those slots).
        i, pv = ipv
        return acc + jax.lax.cond(i < live_chunks, chunk_sum, lambda _: zero, pv), None

    out, _ = jax.lax.scan(add_chunk, zero, (index, (jnp.moveaxis(probs, 4, 0), by_chunk(v))))
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4)
