"""The tests' own user model: a small decoder written as plain JAX functions (not
`logitloop.models`), its attention through `ll.attention` (the contract,
`logitloop.models.kv`): embedding, RMSNorm, RoPE at `positions`, two layers of
grouped-query attention, a SiLU MLP, an LM head. Its products and norms go through
`ll.dense` and `ll.mean`, so `deterministic=True` keeps a row's bits whatever its batch.

`tests/models/test_own_model.py` runs it through every entry point;
`tests/models/test_check_model.py` breaks it on purpose: `apply(bug)` gives the variants the
contract refuses, and the params' `switches` (arrays, so a switched model reuses the
correct one's programs) the ones that compute wrongly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import logitloop as ll

V, E, H, HKV, D, F, L = 96, 32, 4, 2, 8, 64, 2
SPEC = ll.KVSpec(num_layers=L, num_kv_heads=HKV, head_dim=D, dtype=jnp.float32)

# The switches, off: rotate by the column index instead of `positions`; scale the queries
# by this with kv=None only (another training path); add this to the logits when the cache
# is a paged pool (a model that reads the kv's layout); add this [V] to every pass's logits
# (-inf: a masked vocabulary entry; NaN: logits gone NaN).
CORRECT = {
    "column_positions": False,
    "train_q_scale": 1.0,
    "paged_offset": 0.0,
    "vocab_offset": np.zeros(V, np.float32),
}


def init_params(seed: int = 0, **switches) -> dict:
    """Random weights, scaled so that greedy decoding does not just repeat a token."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 8 * L))

    def w(*shape, scale=1.0):
        return scale * jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

    blocks = [
        dict(norm1=1 + 0.1 * w(E), wq=w(E, H * D), wk=w(E, HKV * D), wv=w(E, HKV * D),
             wo=w(H * D, E), norm2=1 + 0.1 * w(E), w_up=w(E, F), w_down=w(F, E))
        for _ in range(L)
    ]  # fmt: skip
    switches = {k: jnp.asarray(v) for k, v in (CORRECT | switches).items()}
    return dict(
        embed=w(V, E, scale=4.0), blocks=blocks, norm=1 + 0.1 * w(E), head=w(E, V, scale=3),
        switches=switches,
    )  # fmt: skip


def rms_norm(x, scale, kv):
    return x * jax.lax.rsqrt(ll.mean(x * x, kv) + 1e-6) * scale


def rope(x, positions):  # x [B, T, heads, D], rotate-half at each token's own position
    freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    angles = positions.astype(jnp.float32)[..., None] * freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply(bug: str | None = None):
    """The model's `apply_fn(params, tokens, positions, kv) -> (logits [B, T, V], kv)`,
    following the contract (`bug=None`), or with one of the bugs the contract refuses:
    "heads" (one key/value head where the spec says two), "dtype" (bfloat16 keys), "never"
    (the last layer skips `ll.attention`), "twice" (every layer writes layer 0), "shape"
    (a logit short) or "input kv" (the kv it was handed returned)."""

    def apply_fn(params, tokens, positions, kv):
        given, switches = kv, params["switches"]
        b, t = tokens.shape
        columns = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.where(switches["column_positions"], columns, positions)
        x = params["embed"][tokens]
        for i, p in enumerate(params["blocks"]):
            h = rms_norm(x, p["norm1"], kv)
            q = ll.dense(h, p["wq"], kv).reshape(b, t, H, D)
            k = ll.dense(h, p["wk"], kv).reshape(b, t, HKV, D)
            v = ll.dense(h, p["wv"], kv).reshape(b, t, HKV, D)
            if kv is None:
                q = q * switches["train_q_scale"]
            if bug == "heads":
                k, v = k[:, :, :1], v[:, :, :1]
            q, k = rope(q, positions), rope(k, positions)
            if bug == "dtype":
                k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            if bug == "never" and i == L - 1:
                out = jnp.repeat(v, H // HKV, axis=2)
            else:
                out, kv = ll.attention(q, k, v, kv, layer=0 if bug == "twice" else i)
            x = x + ll.dense(out.reshape(b, t, H * D).astype(x.dtype), p["wo"], kv)
            h = rms_norm(x, p["norm2"], kv)
            x = x + ll.dense(jax.nn.silu(ll.dense(h, p["w_up"], kv)), p["w_down"], kv)
        logits = ll.dense(rms_norm(x, params["norm"], kv), params["head"], kv)
        logits = logits + switches["vocab_offset"]
        if kv is not None and "k_pages" in kv.caches[0]:
            logits = logits + switches["paged_offset"]
        if bug == "shape":
            logits = logits[..., :-1]
        return logits, (given if bug == "input kv" else kv)

    return apply_fn


apply_fn = apply()


def model(params=None, *, max_length: int = 128, bug: str | None = None) -> ll.FunctionModel:
    """The model as an `ll.FunctionModel` (default weights: `init_params()`)."""
    return ll.FunctionModel(
        apply_fn if bug is None else apply(bug), init_params() if params is None else params,
        kv_spec=SPEC, vocab_size=V, max_length=max_length,
    )  # fmt: skip
