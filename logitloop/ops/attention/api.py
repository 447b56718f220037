"""One entry point for attention over a KV cache: `attention(...)` picks the implementation.

    out = attention(q, k, v, mask, scale, softcap)       # implementation="auto"

The choice (`choose`), made here once per call shape and reported by `describe` (which
`logitloop.decoding.loop.runner.model_info` shows as `ModelInfo.attention`):

- "fixed-order": the deterministic modes (`attention(..., deterministic=True)`, which a
  deterministic runner's numerics pass down; `fixed_order.fixed_order_attention`: every
  sum in 16-slot chunks at fixed boundaries; it builds the dense `[B, T, S]` mask).
- "decode": a single query column (a decode step): the one-product reference over the
  shortest prefix of the cache that holds every visible slot (`decode_attention`), dense
  mask `[B, 1, S]`. Its scores are `[B, H, 1, S]`: nothing to gain from blocks.
- "cudnn": on a GPU, a prompt of half-precision queries over the full cache layout without
  soft-capping: cuDNN's fused flash attention through `jax.nn.dot_product_attention`.
  It only expresses a causal mask whose query i sees keys 0..i, so it runs the calls in
  which every row starts at position 0 (a whole prompt, left padding rolled to the end);
  others (a later chunk of a chunked prefill, a speculative verification) take "blockwise"
  (one `lax.cond`).
- "splash": the same on a TPU, any dtype, head dim a multiple of 8, soft-capped or
  not: jax's splash attention Pallas kernel (`splash.py`), with the same rolled padding
  and fallback.
- "blockwise": everything else with T > 1 (`blockwise.blockwise_attention`: key and
  query blocks, online softmax, masks from positions; temporaries linear in T).
- "reference": only when asked for (`implementation="reference"`): the one-einsum
  attention that holds `[B, H, T, S]` float32 scores, the tests' reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.ops.attention.blockwise import blockwise_attention
from logitloop.ops.attention.fixed_order import fixed_order_attention
from logitloop.ops.attention.fused import whole_prompt
from logitloop.ops.attention.reference import Mask, masked_scores, reference_attention

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "decode", "cudnn", "splash", "fixed-order")

# A single query column attends only a prefix of the cache that holds every visible slot,
# chosen among these fractions of the cache, once the cache has at least this many slots.
# (Below it, one product over every slot costs about as much as the branch would save.)
PREFIX_FRACTIONS = (8, 4, 2)
MIN_PREFIX_SLOTS = 512

# What cuDNN's fused attention takes (jax's `cudnn_dot_product_attention` checks).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def default_backend() -> str:
    """The backend "auto" chooses for (a test that lowers for a TPU on CPU replaces it)."""
    return jax.default_backend()


def choose(
    *,
    columns: int,
    head_dim: int,
    dtype,
    softcap: float | None,
    ring: bool,
    deterministic: bool,
    backend: str | None = None,
) -> str:
    """The implementation "auto" runs for a call of `columns` queries (see the module)."""
    if deterministic:
        return "fixed-order"
    if columns == 1:
        return "decode"
    backend = default_backend() if backend is None else backend
    if (
        backend == "gpu"
        and softcap is None
        and not ring
        and jnp.dtype(dtype) in CUDNN_DTYPES
        and head_dim <= CUDNN_MAX_HEAD_DIM
        and head_dim % 8 == 0
    ):
        return "cudnn"
    if backend == "tpu" and not ring and head_dim % 8 == 0:
        return "splash"
    return "blockwise"


def describe(
    *, head_dim: int, dtype, softcap: float | None, windows, deterministic: bool, backend=None
) -> str:
    """What `choose` picks for a model's prompt passes and decode steps, in words, e.g.
    "prompt: blockwise; decode: decode" (ring layers, which only a sliding window shorter
    than the cache gets, are named when they would differ)."""
    kw = dict(head_dim=head_dim, dtype=dtype, softcap=softcap, deterministic=deterministic)
    prompt = choose(columns=2, ring=False, backend=backend, **kw)
    ring = choose(columns=2, ring=True, backend=backend, **kw)
    decode = choose(columns=1, ring=False, backend=backend, **kw)
    text = f"prompt: {prompt}"
    if ring != prompt and any(w is not None for w in windows):
        text += f" ({ring} on sliding-window rings)"
    return f"{text}; decode: {decode}"


def attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, Hkv, S, D]
    v: jax.Array,  # [B, Hkv, S, D]
    mask: Mask,  # q_pos [B, T]; k_pos [B, S] or None
    scale: float,
    softcap: float | None = None,
    *,
    implementation: str = "auto",
    deterministic: bool = False,
) -> jax.Array:
    """Grouped-query attention of T queries over S keys; returns `[B, T, H, D]`.

    Each of the Hkv key/value heads serves H // Hkv consecutive query heads. Scores and
    softmax are float32; with `softcap` the scaled scores become `softcap * tanh(score /
    softcap)` before masking (Gemma 2). Queries that see no key (padding) return finite
    values that are never read. `deterministic`: every sum in a fixed order (a
    deterministic runner's pass, `logitloop.models.fixed_order.Numerics.fixed`); "auto"
    then picks "fixed-order".
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        implementation = choose(
            columns=q.shape[1],
            head_dim=q.shape[3],
            dtype=q.dtype,
            softcap=softcap,
            ring=mask.k_pos is not None,
            deterministic=deterministic,
        )
    slots = k.shape[2]
    if implementation in ("fixed-order", "decode"):
        fixed = {"deterministic": True} if implementation == "fixed-order" else {}
        if q.shape[1] == 1 and mask.k_pos is None:
            return decode_attention(q, k, v, mask.dense(slots), scale, softcap, **fixed)
        return dense_attention(q, k, v, mask.dense(slots), scale, softcap, **fixed)  # R + T
    if implementation == "reference":
        return reference_attention(q, k, v, mask.dense(slots), scale, softcap)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, mask, scale)
    if implementation == "splash":
        from logitloop.ops.attention.splash import splash_attention

        return splash_attention(q, k, v, mask, scale, softcap)
    return blockwise_attention(q, k, v, mask, scale, softcap)


def dense_attention(q, k, v, mask, scale, softcap=None, *, deterministic: bool = False):
    """`reference_attention` over a dense `[B, T, S]` mask, or with `deterministic` the
    fixed-order attention (`fixed_order.fixed_order_attention`)."""
    if not deterministic:
        return reference_attention(q, k, v, mask, scale, softcap)
    b, t, h, d = q.shape
    hkv = k.shape[1]
    q5 = q.reshape(b, t, hkv, h // hkv, d)  # [B, T, Hkv, G, D]
    out = fixed_order_attention(
        q5,
        k.astype(q.dtype),
        v.astype(q.dtype),
        mask,
        lambda scores, m: masked_scores(scores, m, scale, softcap),
    )
    return out.reshape(b, t, h, d)


def decode_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, Hkv, S, D]
    v: jax.Array,  # [B, Hkv, S, D]
    mask: jax.Array,  # [B, T, S] bool
    scale: float,
    softcap: float | None = None,
    *,
    deterministic: bool = False,
) -> jax.Array:
    """`dense_attention` (`deterministic`: its fixed-order path); a decode step (T = 1)
    over a cache of `MIN_PREFIX_SLOTS` slots or more reads only the shortest of S/8, S/4,
    S/2 or S slots that holds every slot some row may see: with a buffer sized for long
    outputs, the first steps then read a fraction of the cache. Slots past the prefix are
    masked for every row, so the result is the same up to the order of float32 sums.
    """
    slots = k.shape[2]
    if q.shape[1] != 1 or slots < MIN_PREFIX_SLOTS:
        return dense_attention(q, k, v, mask, scale, softcap, deterministic=deterministic)
    extents = sorted({-(-slots // f) for f in PREFIX_FRACTIONS} | {slots})
    # One past the last slot any row may see (0 when no row sees any).
    needed = jnp.max(jnp.where(mask, jnp.arange(1, slots + 1), 0))
    branch = jnp.sum(jnp.asarray(extents[:-1]) < needed)  # the shortest extent >= needed

    def prefix(e):
        return lambda q, k, v, mask: dense_attention(
            q, k[:, :, :e], v[:, :, :e], mask[..., :e], scale, softcap, deterministic=deterministic
        )

    return jax.lax.switch(branch, [prefix(e) for e in extents], q, k, v, mask)


def cudnn_attention(q, k, v, mask: Mask, scale: float, *, library: str = "cudnn"):
    """A whole prompt through `jax.nn.dot_product_attention(implementation=library)`
    (`whole_prompt` says which calls it runs). That kernel's causal mask lets query i see
    keys 0..i of each row's first `query_seq_lengths` queries and keys.
    `library="xla"` runs jax's own XLA implementation of the same call (for tests off GPU).
    """
    window = None if mask.window is None else (mask.window - 1, 0)

    def fused(rolled, keys, values, lengths):
        return jax.nn.dot_product_attention(
            rolled,
            keys.transpose(0, 2, 1, 3),  # [B, T, Hkv, D]
            values.transpose(0, 2, 1, 3),
            scale=scale,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            local_window_size=window,
            implementation=library,
        )

    return whole_prompt(q, k, v, mask, scale, None, fused)
