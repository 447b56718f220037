"""Fixed-order reductions: what `deterministic=True` switches the model layers to.

A row's logits depend on the batch it runs in when a kernel's summation order depends on
the shapes it is given. On XLA:CPU a float32 product `[M, K] x [K, N]` rounds row 0
differently for M = 2..33 than for M = 1 or 64 (permuting rows, or changing the other
rows' contents at a fixed M, changes nothing), and attention sums over however many cache
slots the call reads. In this mode every reduction a row's logits go through has an order
fixed by the model's config alone, never by the batch size, the number of columns in the
call, the cache length or the mesh:

- Products over the hidden or MLP dimension (q/k/v/o projections, the MLP, the LM head;
  `layers.split_heads`, `merge_heads`, `dense`, `DecoderModel.__call__`) run over tiles of
  a fixed number of rows (`rowwise`): `lax.map` over `[M / tile, tile, K]`, M padded up
  with zero rows, so the one product XLA compiles always has `tile` rows. A row's result
  then does not depend on M, nor on its place in its tile, nor on its neighbours. The
  tile is fixed per pass, not per batch: PROMPT_TILE rows for the hidden states of a
  prompt pass, DECODE_TILE for a decode step, a speculative verification and every LM
  head. Prompt tokens only ever go through the prompt pass and generated tokens through
  decode steps or verification, in every batch, slot and chunking, so each position meets
  the same shapes.
  On a mesh with a "data" axis each device's rows are tiled by themselves (`fixed_order(
  mesh=...)`, from the decode loop's layout), so every device runs the one-device tile.
- Attention (`attention`) computes each score as the float32 products of one query and
  one key summed by halving over the head dimension (`tree_sum`: elementwise adds, an
  order fixed by head_dim; as an einsum the order changed with the batch for head_dim 8),
  and sums over cache slots in chunks of `SLOT_CHUNK` slots at fixed absolute boundaries
  (slot 0, 16, 32, ...), each chunk by halving, the chunks then added one after another
  from slot 0 up (a `lax.scan` over the chunks, one chunk per iteration: the loop also
  keeps XLA:CPU from fusing RoPE's sin and cos into the broadcast products and
  recomputing them per slot, which made a prompt pass 3-4x slower). Slots a row may not
  see add exact zeros (exp of the mask value), so slots past a row's last position,
  padding of the cache to a multiple of the chunk, a longer bucket or buffer, or a longer
  prefix of the cache read by a decode step leave the sums unchanged. The maximum is
  exact in any order.
- Norms (RMSNorm, LayerNorm, QK-norm) take their means by halving over the row (`mean`).
  RoPE, activations, residual adds and the embedding are elementwise or gathers, the
  same for a row wherever it sits (with the library fusions off, below).

Keys and values are read from the cache, where slot == position, so chunked prefill and
one pass give the same sums. Sliding-window rings (`layers.ring_mask`) hold slots in
`position % R` order plus this call's columns, so for a layer with a ring the order is
fixed for a given call shape only (batch size and composition, not prefill chunking or
the bucket); the mixture-of-experts MLP (`moe.py`) is not covered.

Fixed orders are not enough by themselves on XLA:CPU: above a size threshold it hands
fusions (a reduce, an `exp(x - max)`, elementwise code around a product) to YNNPACK
kernels, whose order and whose `exp` differ from XLA's own code, so the same row computed
in a bigger array comes out different. Programs of a deterministic runner are compiled
with those fusions off except YNNPACK's individual dots (`compiler_options`, applied by
`decoding.model.runner_jit`): a dot alone, of one fixed tile shape, gives each row the
same bits whatever the other rows and the program around it (tested), and it is faster
than XLA:CPU's own dot (BENCHMARKS.md, "Deterministic decoding").

`fixed_order(True, prompt=...)` is entered by `decoding.model.ModelRunner.forward` (and
`forward_columns`) while the model is traced; outside it every primitive here is the plain
XLA op.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from logitloop.models.partitioning import DATA_AXIS

# Rows per product tile, by the pass. Plain products are not row-invariant even with
# XLA:CPU's library fusions off (a row alone and in a batch of 8 differ by ~4e-6 in float32
# logits), and a GPU library picks its kernel (and its split of the contraction) by the row
# count. A prompt pass (`loop.forward_prompt`, chunked or not) runs its hidden-state
# products over tiles of PROMPT_TILE rows (a batch's prompts are many rows: few, big
# tiles); a decode step and a speculative verification (generated tokens), and every LM
# head (one row per sequence), over tiles of DECODE_TILE rows. A token position is always
# computed by the same pass whatever the batch (prompt tokens by the prompt pass,
# generated ones by decode or verification), so each product it goes through always has
# the same shape.
PROMPT_TILE = 64
DECODE_TILE = 8
# Cache slots per attention chunk (a divisor of every cache length `generate`
# allocates: prompt and buffer buckets are multiples of 16).
SLOT_CHUNK = 16

# XLA:CPU options of a deterministic program: of the library fusions, which XLA:CPU picks
# by array size and which can take in the ops around them (a reduce, an `exp(x - max)`,
# elementwise code) with another order and another `exp`, only YNNPACK's individual dots
# stay: each is one product of a fixed tile shape, whose rows do not depend on each other
# (`tests/decoding/test_deterministic.py`, the tile-product test).
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "xla_cpu_experimental_xnn_fusion_type": "",
}

# None (plain ops), "prompt" or "decode": the pass being traced in fixed-order mode.
_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "logitloop_fixed_order", default=None
)
# The mesh whose "data" axis holds the rows of the pass being traced, if any.
_ROW_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "logitloop_fixed_order_mesh", default=None
)


@contextlib.contextmanager
def fixed_order(
    enabled: bool = True, *, prompt: bool = False, mesh: Mesh | None = None
) -> Iterator[None]:
    """While tracing inside this context, the layers use fixed-order reductions; `prompt`:
    the call is a prompt pass (row tiles of PROMPT_TILE), else a decode step or a
    verification (DECODE_TILE); `mesh`: the rows lie over this mesh's "data" axis, so each
    device tiles its own rows (`rowwise`)."""
    token = _ACTIVE.set(("prompt" if prompt else "decode") if enabled else None)
    mesh_token = _ROW_MESH.set(mesh if enabled else None)
    try:
        yield
    finally:
        _ROW_MESH.reset(mesh_token)
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether the layers being traced use fixed-order reductions."""
    return _ACTIVE.get() is not None


def row_tile(*, head: bool = False) -> int:
    """Rows per product tile in the pass being traced (`head`: the LM head's product)."""
    return PROMPT_TILE if _ACTIVE.get() == "prompt" and not head else DECODE_TILE


def compiler_options() -> dict[str, str]:
    """XLA options for a deterministic program on the default backend."""
    return dict(CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


def rowwise(fn: Callable[[jax.Array], jax.Array], x: jax.Array, *, head: bool = False) -> jax.Array:
    """`fn(x)` for a row-wise `fn: [M, K] -> [M, N]`; in fixed-order mode over tiles of
    `row_tile(head=head)` rows, so that every product XLA compiles in a given pass has the
    same shape on every device.

    With the rows over a mesh's "data" axis of size D (the M rows in D contiguous blocks,
    one per device), each device's block is padded and tiled by itself: the tiles go
    through `lax.map` as `[D, tile, K]`, D over "data", so every device runs a
    `[tile, K]` product on its own rows, as one device does. (Tiling the global rows
    instead would let the partitioner split a tile's rows over the devices: on a (8, 1)
    mesh at batch 8 each device then ran one-row products, which round differently.)"""
    if not active():
        return fn(x)
    tile = row_tile(head=head)
    mesh = _ROW_MESH.get()
    d = mesh.shape[DATA_AXIS] if mesh is not None else 1
    m, k = x.shape
    if m % d:
        raise ValueError(f"{m} rows do not split over a data axis of size {d}")
    per = m // d
    blocks = jnp.pad(x.reshape(d, per, k), ((0, 0), (0, -per % tile), (0, 0)))
    tiles = blocks.reshape(d, -1, tile, k).transpose(1, 0, 2, 3)  # [T, D, tile, K]
    if mesh is not None:
        spec = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))
        tiles = jax.lax.with_sharding_constraint(tiles, spec)
    out = jax.lax.map(lambda t: fn(t.reshape(d * tile, k)).reshape(d, tile, -1), tiles)
    out = out.transpose(1, 0, 2, 3).reshape(d, -1, out.shape[-1])[:, :per]  # [D, per, N]
    return out.reshape(m, out.shape[-1])


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """The sum over `axis` by halving: entry i is added to entry i + n/2 (an odd length
    gains a zero) until one is left. Only elementwise adds of slices, whose order is fixed
    by the axis length alone; XLA's reduce, by contrast, changes its order with the size of
    the whole array (on XLA:CPU a row of 256 sums differently once there are 16 rows)."""
    x = jnp.moveaxis(x, axis, -1)
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def mean(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jnp.mean(x, axis, keepdims=True)`; in fixed-order mode through `tree_sum`."""
    if not active():
        return jnp.mean(x, axis=axis, keepdims=True)
    return jnp.expand_dims(tree_sum(x, axis) / x.shape[axis], axis)


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """The sum over `axis`, added one entry after another from index 0 (a chain of adds,
    which XLA does not reassociate): trailing exact zeros do not change it."""
    parts = [jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def attention(
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
        # [B, Hkv, G, T, 1, D] * [B, Hkv, 1, 1, 16, D] summed over D (one fixed size)
        return tree_sum(q32[:, :, :, :, None, :] * kc.astype(jnp.float32)[:, :, None, None])

    scores = jax.lax.map(chunk_scores, by_chunk(k))  # [C, B, Hkv, G, T, 16]
    scores = jnp.moveaxis(scores, 0, 4).reshape(b, hkv, g, t, chunks * SLOT_CHUNK)
    scores = masked_scores(scores, mask[:, None, None, :, :])  # [B, Hkv, G, T, S]
    peak = jnp.max(scores, axis=-1, keepdims=True)  # exact in any order
    exp = jnp.exp(scores - peak).reshape(b, hkv, g, t, chunks, SLOT_CHUNK)
    total = ordered_sum(tree_sum(exp), axis=-1)  # [B, Hkv, G, T]
    probs = (exp / total[..., None, None]).astype(q.dtype)

    def add_chunk(acc, pv):  # chunk after chunk from slot 0: acc + this chunk's sum
        p, vc = pv  # [B, Hkv, G, T, 16], [B, Hkv, 16, D]
        # [B, Hkv, G, T, 16, 1] * [B, Hkv, 1, 1, 16, D] summed over the chunk's slots
        part = tree_sum(
            p.astype(jnp.float32)[..., None] * vc.astype(jnp.float32)[:, :, None, None],
            axis=-2,
        )
        return acc + part, None

    zero = jnp.zeros((b, hkv, g, t, d), jnp.float32)
    out, _ = jax.lax.scan(add_chunk, zero, (jnp.moveaxis(probs, 4, 0), by_chunk(v)))
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4)
