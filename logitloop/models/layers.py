"""Building blocks shared by the model implementations.

The KV cache and its masks live here once, and every layer attends through
`logitloop.ops.attention.attention` (`cached_attention`), so every architecture follows the
same protocol (see `logitloop.models.decoder.DecoderModel.__call__`):

- The cache of one layer is `dict(k=[B, Hkv, S, D], v=[B, Hkv, S, D])`; slot `s` holds the
  key/value of the token at absolute position `s` in that row. Heads come before slots so
  that attention is a plain batched matrix product over (row, head): with slots first,
  XLA:CPU copies the whole cache into that order at every step.
- `positions[b, t]` is the absolute position of column `t` of row `b`, or -1 for padding.
  Real tokens are written to slot `positions[b, t]`; padding is mapped to slot `S`, which
  a `mode="drop"` scatter discards. Positions must stay below S (the caller sizes the
  cache): a write at S or beyond is dropped too.
- A query at position `q` sees slots `s <= q` (and `s > q - window` with a sliding
  window). A padded query (`q == -1`) sees nothing: its scores are all the same large
  finite negative, so its softmax is uniform rather than NaN, and its output is unused.

Sliding-window layers (Mistral, Qwen2/3 when configured, Phi-3, Mixtral, Gemma 2/3's
local layers) keep a ring instead when the window is shorter than the cache: `R = window +
RING_SLACK` slots (`ring_slots`), `dict(k=[B, Hkv, R, D], v=[B, Hkv, R, D], pos=[B, R])`,
where slot `p % R` holds the token at position `p` and `pos` says which position each
slot holds (-1: none). A call attends the ring *as it was before the call* together with
its own columns (`ring_keys`), then writes them (`write_ring`), so a call may be longer
than the window or the ring (a long prefill). Ring entries at or past a row's first
position in the call are ignored: they are columns taken back (speculative drafts that
were rejected), which the caller may rewrite; up to `RING_SLACK` columns may be taken
back before the ring would have dropped a key still inside the window. A layer's memory
is then fixed by its window, not by the context (Gemma 3: five layers in six). Of a call
longer than the ring only each row's last R positions are written, so no slot is written
twice in one scatter (whose order XLA leaves unspecified off CPU).

A paged cache (`init_paged_caches`) keeps each layer's keys and values in a pool of pages
shared by the rows, `dict(k_pages=[Hkv, N, page_size, D], v_pages=..., tables=[B, P])`:
row b's token at position p is slot `p % page_size` of page `tables[b, p // page_size]`
(`logitloop.ops.attention.paged`; which row holds which page is
`logitloop.decoding.loop.pages`). It reads as a full-layout cache of S = P * page_size slots,
with the same masks: a call writes its columns into the pages (`write_pages`), then a
decode step (T = 1) runs paged decode attention over the row's live pages, and a longer
call attends the row's pages gathered into the full layout. Sliding windows are masks
there, not rings. A layer may also hold `prefix` (`share_prefix`): rows in groups that
share their first pages, which a decode step then reads once per group.

Example: S = 8, two rows, a prefill of T = 4 with row 0 holding 2 real tokens:

    positions = [[-1, -1, 0, 1],
                 [ 0,  1, 2, 3]]

writes row 0 slots 0-1 and row 1 slots 0-3; the next step passes positions [[2], [4]].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logitloop.models import fixed_order
from logitloop.models.checkpoint import CheckpointTensor  # noqa: F401 - re-exported
from logitloop.models.config import RopeConfig
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.partitioning import DATA_AXIS, MODEL_AXIS
from logitloop.ops import attention as ops_attention
from logitloop.ops.attention import MASK_VALUE, Mask, soft_cap  # noqa: F401 - re-exported

KVCache = list[dict[str, jax.Array]]


def param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    dtype: jnp.dtype,
    names: tuple[str | None, ...],
    *,
    init: str = "normal",
    stddev: float = 0.02,
) -> nnx.Param:
    """A parameter with logical axis names for later placement over a device mesh.

    `names` go into the Variable's sharding metadata (`nnx.get_partition_spec` reads them).
    Eager sharding is off: the model is built without a mesh and laid out afterwards by
    mapping these logical names onto mesh axes. `rngs=None` builds zeros instead of random
    weights: for shapes only (`nnx.eval_shape`, where tracing a random normal per parameter
    costs more than reading a small checkpoint) or weights that are set right after.
    """
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def activation(name: str, x: jax.Array) -> jax.Array:
    """The Hugging Face activation called `name` (see `config.SUPPORTED_ACTIVATIONS`)."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"unsupported activation {name!r}")


def rms_norm(
    x: jax.Array, scale: jax.Array, eps: float, *, numerics: Numerics = PLAIN
) -> jax.Array:
    """RMSNorm over the last axis, as `transformers` computes it.

    The statistics run in float32 and the normalised value is cast back to `x.dtype`
    before the scale multiplies it, which is what keeps bfloat16 results close to HF.
    `numerics`: the pass's policy (`fixed_order.Numerics`; the mean by halving when fixed).
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(fixed_order.mean(x32 * x32, numerics=numerics) + eps)
    return scale * x32.astype(x.dtype)


def gemma_rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, *, numerics: Numerics = PLAIN
) -> jax.Array:
    """Gemma's RMSNorm: scale by `1 + weight`, all in float32, then cast to `x.dtype`
    (Llama casts before scaling; Gemma multiplies first, as `transformers` does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(fixed_order.mean(x32 * x32, numerics=numerics) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def layer_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, *, numerics: Numerics = PLAIN
) -> jax.Array:
    """LayerNorm over the last axis; statistics in float32, result in `x.dtype`."""
    x32 = x.astype(jnp.float32)
    mean = fixed_order.mean(x32, numerics=numerics)
    var = fixed_order.mean(jnp.square(x32 - mean), numerics=numerics)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def split_heads(
    x: jax.Array, w: jax.Array, *, numerics: Numerics = PLAIN, lora: Any = None
) -> jax.Array:
    """`x @ w` for a head-split weight: `[B, T, E] x [E, ..., D] -> [B, T, ..., D]`
    (`lora`: as in `dense`, over `w` seen as `[E, rest]`).

    One 2-D product on `w` seen as `[E, rest]` (a free reshape of its row-major layout).
    Written as an einsum over the head axes, XLA:CPU chose dimension orders that copied
    the weight (or the activation) at every decode step.
    """
    # The width spelled out (not -1): a quantized weight (a Qwix QArray) reshapes its
    # scales with it and takes only explicit shapes.
    out = dense(x, w.reshape(w.shape[0], math.prod(w.shape[1:])), numerics=numerics, lora=lora)
    return out.reshape(*x.shape[:-1], *w.shape[1:])


def merge_heads(
    x: jax.Array, w: jax.Array, *, numerics: Numerics = PLAIN, lora: Any = None
) -> jax.Array:
    """The output projection `[B, T, H, D] x [H, D, E] -> [B, T, E]`, as one 2-D product
    (whose contraction a model-parallel mesh splits by heads; `lora` as in `dense`)."""
    b, t, h, d = x.shape
    x, w = x.reshape(b, t, h * d), w.reshape(h * d, w.shape[-1])
    return dense(x, w, groups=h, numerics=numerics, lora=lora)


def dense(
    x: jax.Array,
    w: jax.Array,
    *,
    groups: int = 1,
    numerics: Numerics = PLAIN,
    lora: Any = None,
) -> jax.Array:
    """`x @ w`, `[..., K] x [K, N] -> [..., N]`, as one 2-D product over the rows of `x`
    (over fixed-size row tiles and fixed contraction chunks under a deterministic
    `numerics` policy, `fixed_order.Numerics`, so a
    row's result does not depend on how many rows there are, nor on the mesh). `groups`:
    the equal blocks a model-parallel mesh may split the contraction into (K for a
    contraction over the MLP axis, 1 over the embedding). `lora`: the pass's adapters of
    this projection (`lora.Site`, from `lora.site(kv.rows, layer, target)`) or None: each
    token's adapter update is added (`logitloop.models.lora`)."""
    out = fixed_order.rowwise(
        lambda rows: fixed_order.product(rows, w, groups=groups, numerics=numerics),
        x.reshape(-1, x.shape[-1]),
        numerics=numerics,
        shape=(x.shape[-1], w.shape[-1]),
    ).reshape(*x.shape[:-1], w.shape[-1])
    return out if lora is None else out + lora.delta(x, groups=groups, numerics=numerics)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-frequency inverse wavelengths, `[rotary_dim // 2]` float32, where rotary_dim is
    `head_dim * rope.partial_rotary_factor` (all of it unless Phi-3 says otherwise).

    Computed on the host with numpy, so under `jit` they are constants. For "longrope"
    these are the short-context frequencies (`longrope_frequencies` gives both).
    """
    dim = rotary_dim(rope, head_dim)
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "longrope":
        return longrope_frequencies(rope, head_dim)[0]
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # in between interpolated (transformers' `_compute_llama3_parameters`).
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported RoPE type {rope.rope_type!r}")


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading channels of each head RoPE rotates."""
    return int(head_dim * rope.partial_rotary_factor)


def longrope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3's (short, long) inverse frequencies: `1 / (factor_i * theta ** (2i / dim))`,
    as transformers' `_compute_longrope_parameters`."""
    dim = rotary_dim(rope, head_dim)
    for name in ("short_factor", "long_factor"):
        if len(getattr(rope, name)) != dim // 2:
            raise ValueError(
                f"RoPE {name} has {len(getattr(rope, name))} entries; the {dim} rotated "
                f"channels need {dim // 2}"
            )
    base = np.float32(rope.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    return tuple(
        (1.0 / (np.asarray(f, np.float32) * base)).astype(np.float32)
        for f in (rope.short_factor, rope.long_factor)
    )


def apply_rope(
    x: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # [B, T] int
    inv_freq: np.ndarray | jax.Array,  # [R // 2], or per row [B, R // 2]; R <= D
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotate `x` by its positions, with HF's rotate-half (not interleaved) layout.

    Only the first R = 2 * inv_freq.shape[-1] channels rotate (partial rotary); the rest
    pass through. Angles, cos and sin are computed in float32 (cos and sin times
    `attention_factor`) and cast to `x.dtype` before they multiply, as `transformers`
    does. Padded positions (-1) get a rotation too; it is never read.
    """
    inv_freq = jnp.asarray(inv_freq)
    if inv_freq.ndim == 2:
        inv_freq = inv_freq[:, None, :]  # [B, 1, R/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, R]
    cos = (jnp.cos(angles) * attention_factor).astype(x.dtype)
    sin = (jnp.sin(angles) * attention_factor).astype(x.dtype)
    r = angles.shape[-1]
    x, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos + rotated * sin
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


def rope_qk(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, T, Hkv, D]
    positions: jax.Array,  # [B, T] int, -1 for padding
    rope: RopeConfig,
    head_dim: int,
) -> tuple[jax.Array, jax.Array]:
    """Queries and keys rotated by `rope` (its frequencies are host constants).

    "longrope" picks, per row, the long frequencies when the row's last position in this
    call is at or past `original_max_position_embeddings` (transformers picks them for a
    whole forward when `max(position_ids) + 1` exceeds it; per row, a batch gives each
    prompt what it gets alone). Keys already in the cache keep the rotation they were
    written with, as in transformers.
    """
    if rope.rope_type == "longrope":
        short, long = longrope_frequencies(rope, head_dim)
        use_long = jnp.max(positions, axis=1) + 1 > rope.original_max_position_embeddings
        inv_freq = jnp.where(use_long[:, None], long, short)  # [B, R/2]
    else:
        inv_freq = rope_inverse_frequencies(rope, head_dim)
    factor = rope.attention_factor
    return apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)


def init_kv_cache(
    batch_size: int, max_length: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    """Zeros: one `dict(k=[B, Hkv, S, D], v=[B, Hkv, S, D])` per layer, S = max_length."""
    shape = (batch_size, num_kv_heads, max_length, head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(num_layers)]


# How many written columns a caller may take back and rewrite in a sliding-window ring.
RING_SLACK = 8


def ring_slots(window: int | None, max_length: int) -> int | None:
    """The ring size of a layer with this window in a cache of `max_length` slots, or None
    when the layer keeps the full layout (no window, or one the cache never exceeds)."""
    if window is None or window + RING_SLACK >= max_length:
        return None
    return window + RING_SLACK


def init_layer_caches(
    batch_size: int,
    max_length: int,
    windows: Sequence[int | None],
    num_kv_heads: int,
    head_dim: int,
    dtype,
) -> KVCache:
    """Zeros: per layer the full `dict(k, v)` of `max_length` slots, or, for a window
    shorter than the cache, a ring `dict(k, v, pos)` of `ring_slots(window, ...)` slots."""
    out = []
    for window in windows:
        ring = ring_slots(window, max_length)
        slots = max_length if ring is None else ring
        shape = (batch_size, num_kv_heads, slots, head_dim)
        layer = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
        if ring is not None:
            layer["pos"] = jnp.full((batch_size, ring), -1, jnp.int32)
        out.append(layer)
    return out


def init_paged_caches(
    num_layers: int,
    num_pages: int | Sequence[int],
    page_size: int,
    tables: jax.Array,  # [B, P] int32
    num_kv_heads: int,
    head_dim: int,
    dtype,
) -> KVCache:
    """Zeros: per layer a pool `dict(k_pages=[Hkv, N, page_size, D], v_pages=..., tables)`
    of N = `num_pages` pages (or `num_pages[i]` for layer i), every layer with the same page
    tables (the caller replaces `tables` when rows gain or lose pages)."""
    if isinstance(num_pages, (int, np.integer)):
        num_pages = (int(num_pages),) * num_layers
    shapes = [(num_kv_heads, n, page_size, head_dim) for n in num_pages]
    return [
        {"k_pages": jnp.zeros(shape, dtype), "v_pages": jnp.zeros(shape, dtype), "tables": tables}
        for shape in shapes
    ]


def copy_pages(cache: KVCache, source: jax.Array, target: jax.Array, mesh=None) -> KVCache:
    """Every paged layer with page `source[i]` copied onto page `target[i]` (`[R]` int32; a
    target outside the pool is skipped): the copy-on-write of a forked row's partial last
    page (`logitloop.decoding.loop.pages.fork`). `mesh`: the R rows and the pages lie over
    its data axis, each row's two pages in its shard (`by_page_shard`)."""

    def copy(rows, pools, pairs):
        source, target = pairs[:, 0], pairs[:, 1]

        def one(pages):  # [Hkv, N, page_size, D]
            taken = pages[:, jnp.clip(source, 0, pages.shape[1] - 1)]
            return pages.at[:, target].set(taken, mode="drop")

        return rows, jax.tree.map(one, pools)

    pools = [(layer["k_pages"], layer["v_pages"]) for layer in cache]
    _, pools = by_page_shard(copy, mesh, (), pools, jnp.stack([source, target], axis=1))
    return [dict(layer, k_pages=k, v_pages=v) for layer, (k, v) in zip(cache, pools, strict=True)]


def share_prefix(
    cache: KVCache,
    tables: jax.Array,  # [U, Ps] int32
    lengths: jax.Array,  # [U] int32, multiples of page_size
    suffix_entries: int,
) -> KVCache:
    """Every paged layer told that its rows come in U groups of `B // U` consecutive rows,
    group u's tables starting with the `lengths[u]` tokens of full pages `tables[u]`, and
    no row holding more than `suffix_entries` pages after them (`ops.attention.paged.
    SharedPrefix`): a decode step then reads those pages once per group, not once per row
    (`paged.cascade_attention`). Safe when a row stops sharing: it is then read through its
    own table."""
    from logitloop.ops.attention import paged  # as `_paged_cached_attention`: Pallas

    prefix = paged.SharedPrefix(tables, lengths, suffix_entries)
    return [dict(layer, prefix=prefix) for layer in cache]


def layer_slots(layer: dict[str, jax.Array]) -> int:
    """The slots S one layer's masks span: the full layout's S, a ring's R, or for a paged
    layer its table's P * page_size."""
    if "tables" in layer:
        return layer["tables"].shape[1] * layer["k_pages"].shape[2]
    return layer["k"].shape[2]


def cache_slots(cache: KVCache) -> int:
    """The number of slots S of a full-layout cache (its first full layer's)."""
    full = [layer for layer in cache if "pos" not in layer] or cache
    return full[0]["k"].shape[2]


def ring_keys(
    positions: jax.Array,  # [B, T] int, -1 for padding
    ring_pos: jax.Array,  # [B, R] int: the position each ring slot holds, -1 for none
) -> jax.Array:
    """`[B, R + T]`: the positions a call attends in a ring layer, the ring's slots (the
    first R keys) then this call's columns; -1 for an empty slot, padding, and a ring
    entry at or past the row's first position in the call (a column taken back)."""
    real = jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max)
    first = jnp.min(real, axis=1, keepdims=True)  # [B, 1]: the row's first position
    return jnp.concatenate([jnp.where(ring_pos < first, ring_pos, -1), positions], axis=1)


def layer_mask(
    positions: jax.Array,  # [B, T] int, -1 for padding
    cache: dict[str, jax.Array],  # one layer's cache, full or a ring
    window: int | None,
) -> Mask:
    """Which keys each query of a call sees in this layer, as positions (`Mask`): the
    cache's slots (slot == position), or a ring's slots and the call's columns."""
    if "pos" in cache:
        return Mask(positions, ring_keys(positions, cache["pos"]), window)
    return Mask(positions, None, window)


def ring_mask(
    positions: jax.Array,  # [B, T] int, -1 for padding
    ring_pos: jax.Array,  # [B, R] int: the position each ring slot holds, -1 for none
    window: int,
) -> jax.Array:
    """`[B, T, R + T]` bool: may the query in column t see ring slot r (the first R keys)
    or column t' of this call (the last T), under causality and the window."""
    keys = ring_keys(positions, ring_pos)
    return Mask(positions, keys, window).dense(keys.shape[1])


def write_ring(
    cache: dict[str, jax.Array],  # k, v: [B, Hkv, R, D]; pos: [B, R]
    k: jax.Array,  # [B, T, Hkv, D]
    v: jax.Array,  # [B, T, Hkv, D]
    positions: jax.Array,  # [B, T] int, -1 for padding
) -> dict[str, jax.Array]:
    """Write each real column to slot `position % R`; of a call longer than the ring only
    the last R positions of each row are kept (no slot is written twice)."""
    r = cache["pos"].shape[1]
    last = jnp.max(positions, axis=1, keepdims=True)  # [B, 1]
    keep = (positions >= 0) & (positions > last - r)
    slot = jnp.where(keep, positions % r, r)  # r: dropped

    def put(c, x, s):  # c: [Hkv, R, D], x: [T, Hkv, D]
        return c.at[:, s].set(x.transpose(1, 0, 2).astype(c.dtype), mode="drop")

    return {
        "k": jax.vmap(put)(cache["k"], k, slot),
        "v": jax.vmap(put)(cache["v"], v, slot),
        "pos": jax.vmap(lambda p, x, s: p.at[s].set(x, mode="drop"))(cache["pos"], positions, slot),
    }


def write_cache(
    cache: jax.Array,  # [B, Hkv, S, D]
    values: jax.Array,  # [B, T, Hkv, D]
    positions: jax.Array,  # [B, T] int, -1 for padding
) -> jax.Array:
    """Scatter each real token's values into slot == its position; drop padding."""
    slots = cache.shape[2]
    # Padding, and anything past the end, goes to slot S, which mode="drop" discards.
    slot = jnp.where((positions >= 0) & (positions < slots), positions, slots)  # [B, T]
    values = values.astype(cache.dtype).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    return jax.vmap(lambda c, v, s: c.at[:, s].set(v, mode="drop"))(cache, values, slot)


def write_pages(
    pages: jax.Array,  # [Hkv, N, page_size, D]
    values: jax.Array,  # [B, T, Hkv, D]
    positions: jax.Array,  # [B, T] int, -1 for padding
    tables: jax.Array,  # [B, P] int32
) -> jax.Array:
    """Scatter each real token's values into its row's page (the module docstring); drop
    padding, positions past the table and positions whose entry names no page (-1, a row
    that was not given the page). Two rows never write one slot: a shared page is a full
    one, below both rows' positions (`logitloop.decoding.loop.pages`)."""
    hkv, num_pages, page_size, d = pages.shape
    entries = tables.shape[1]
    entry = jnp.clip(positions // page_size, 0, entries - 1)
    page = jnp.take_along_axis(tables, entry, axis=1)  # [B, T]
    real = (positions >= 0) & (positions < entries * page_size) & (page >= 0)
    slot = jnp.where(real, page * page_size + positions % page_size, num_pages * page_size)
    values = values.astype(pages.dtype).transpose(2, 0, 1, 3).reshape(hkv, -1, d)
    flat = pages.reshape(hkv, num_pages * page_size, d)
    return flat.at[:, slot.reshape(-1)].set(values, mode="drop").reshape(pages.shape)


def attention_mask(
    positions: jax.Array,  # [B, T] int, -1 for padding
    num_slots: int,
    window: int | None,
) -> jax.Array:
    """`[B, T, S]` bool: may the query in column t see cache slot s."""
    return Mask(positions, None, window).dense(num_slots)


# The decode step's prefix path and the dense-mask attention (fixed-order with
# `deterministic=True`), by the names the model tests call them.
attend = ops_attention.decode_attention
_attend = ops_attention.dense_attention
PREFIX_FRACTIONS = ops_attention.api.PREFIX_FRACTIONS


def cached_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, T, Hkv, D]
    v: jax.Array,  # [B, T, Hkv, D]
    positions: jax.Array,  # [B, T] int, -1 for padding
    cache: dict[str, jax.Array],  # k, v: [B, Hkv, S, D]
    mask: Mask,  # from `layer_mask`
    scale: float,
    softcap: float | None = None,
    *,
    numerics: Numerics = PLAIN,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Write this call's keys/values into one layer's cache, then attend over the cache
    (a full-layout cache), or attend the ring and this call's columns, then write (a
    sliding-window ring, see the module docstring); `logitloop.ops.attention.attention`
    picks the implementation (the fixed-order one under a deterministic `numerics`).

    Returns the attention output `[B, T, H, D]` and the updated cache.
    """
    fixed = numerics.fixed
    if "tables" in cache:  # a paged layer
        return _paged_cached_attention(q, k, v, positions, cache, mask, scale, softcap, numerics)
    if "pos" in cache:  # a sliding-window ring: `mask` holds `ring_keys`, [B, R + T]
        keys = jnp.concatenate([cache["k"], k.transpose(0, 2, 1, 3).astype(cache["k"].dtype)], 2)
        values = jnp.concatenate([cache["v"], v.transpose(0, 2, 1, 3).astype(cache["v"].dtype)], 2)
        out = ops_attention.attention(q, keys, values, mask, scale, softcap, deterministic=fixed)
        return out, write_ring(cache, k, v, positions)
    cache = {
        "k": write_cache(cache["k"], k, positions),
        "v": write_cache(cache["v"], v, positions),
    }
    out = ops_attention.attention(
        q, cache["k"], cache["v"], mask, scale, softcap, deterministic=fixed
    )
    return out, cache


def _paged_cached_attention(q, k, v, positions, cache, mask: Mask, scale, softcap, numerics):
    """`cached_attention` for a paged layer: write, then a decode step (T = 1) runs paged
    decode attention over each row's live pages, from the first position its window shows
    to its own (with the layer's `prefix`, `share_prefix`, a group's shared pages are read
    once for the group's rows; not on a mesh); a longer call, or a fixed-order one, attends
    the pages gathered into the full layout (slot == position, so `mask` applies as it
    is). With the rows over a mesh's data axis (`numerics.row_mesh`) the writes and reads
    run on each data shard's own rows and pages (`by_page_shard`)."""
    # Imported here: Pallas takes a tenth of a second to import, and only paged caches
    # need it.
    from logitloop.ops.attention import paged

    decode = q.shape[1] == 1 and not numerics.fixed
    mesh = numerics.row_mesh
    # A group's shared pages (`share_prefix`) hold global page numbers and groups of rows
    # across the data shards: a mesh reads each row's own table.
    prefix = cache.get("prefix") if mesh is None else None

    def write_and_read(rows, pools, tables):
        q, k, v, positions = rows
        pools = tuple(
            write_pages(p, x, positions, tables) for p, x in zip(pools, (k, v), strict=True)
        )
        if not decode:
            return tuple(paged.gather_pages(p, tables) for p in pools), pools  # [B, Hkv, S, D]
        pos = positions[:, 0]  # [B], -1 for a row that feeds nothing
        lengths = jnp.maximum(pos + 1, 0).astype(jnp.int32)  # [B]
        starts = jnp.zeros_like(lengths)
        if mask.window is not None:
            starts = jnp.maximum(pos - mask.window + 1, 0).astype(jnp.int32)
        out = paged.paged_attention(
            q[:, 0], *pools, tables, lengths, starts, scale=scale, softcap=softcap,
            sharded=mesh is not None, prefix=prefix,
        )  # fmt: skip
        return out[:, None], pools  # [B, 1, H, D]

    tables = cache["tables"]
    pools = (cache["k_pages"], cache["v_pages"])
    out, pools = by_page_shard(write_and_read, mesh, (q, k, v, positions), pools, tables)
    cache = dict(cache, k_pages=pools[0], v_pages=pools[1])
    if decode:
        return out, cache
    keys, values = out
    return ops_attention.attention(
        q, keys, values, mask, scale, softcap, deterministic=numerics.fixed
    ), cache


def by_page_shard(fn: Callable, mesh, rows: tuple, pools: tuple, tables: jax.Array):
    """`fn(rows, pools, tables) -> (row outputs, pools)`, on each data shard of `mesh` by
    itself: its block of the rows (`rows`: arrays `[B, ...]`, `tables` `[B, P]`) and its
    block of the pages (`pools`: arrays `[Hkv, N, page_size, D]`, N over "data"), the table
    entries made block-local. The page bookkeeping gives a row of block i pages of block i
    only (`logitloop.decoding.loop.pages`, `PageState.shards`), so no device reads or
    writes another's pages and GSPMD never gathers the pool. Without a mesh, a data axis
    of 1 or rows that do not split over it, `fn` runs on the whole arrays."""
    shards = 1 if mesh is None else mesh.shape[DATA_AXIS]
    if shards == 1 or tables.shape[0] % shards:
        return fn(rows, pools, tables)
    axis = DATA_AXIS
    heads, block = jax.tree.leaves(pools)[0].shape[:2]
    block //= shards
    # A model axis that splits the pool's heads stays GSPMD's (the heads' work splits over
    # it); one that does not leaves every device of a data shard the shard's whole pool,
    # and the shard's work then runs whole on each (else GSPMD splits the writes over the
    # model axis and gathers the pool back every step).
    names = {axis} if heads % mesh.shape[MODEL_AXIS] == 0 else {axis, MODEL_AXIS}

    def local(rows, pools, tables):
        first = jax.lax.axis_index(axis) * block
        return fn(rows, pools, jnp.where(tables >= 0, tables - first, -1))

    row, pool = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec(None, axis)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(row, pool, row),
        out_specs=(row, pool),
        axis_names=names,
        check_vma=False,
    )(rows, pools, tables)
