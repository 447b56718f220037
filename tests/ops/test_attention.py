"""`logitloop.ops.attention`: blockwise attention against the one-einsum reference, the
dispatch, and the models run through it.

Blocks here are a few slots wide so that short calls cross many of them: the last key block
moved back to end at the cache's end, query blocks padded, blocks skipped past the causal
edge or before the window, rings whose slots hold positions out of order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logitloop.decoding.loop.runner import model_info
from logitloop.models import LlamaConfig, LlamaModel, layers, registry
from logitloop.models.config import HFConfig
from logitloop.ops import attention as ops
from logitloop.ops.attention import api, blockwise
from tests.models.tiny_checkpoints import CASES


def _positions(rng, batch, columns, slots, fresh=False):
    """`[B, T]`: each row left-padded by a random amount, its real columns at consecutive
    positions from a random offset (0 when `fresh`) that keeps them below `slots`."""
    pos = np.full((batch, columns), -1, np.int32)
    for r in range(batch):
        pad = int(rng.integers(0, columns // 2 + 1))
        start = 0 if fresh else int(rng.integers(0, slots - columns + 1))
        pos[r, pad:] = start + np.arange(columns - pad)
    return pos


def _qkv(rng, batch, columns, heads, kv_heads, slots, d):
    q = rng.standard_normal((batch, columns, heads, d)).astype(np.float32)
    k = 2 * rng.standard_normal((batch, kv_heads, slots, d)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, slots, d)).astype(np.float32)
    return q, k, v


def _float64(q, k, v, mask, scale, softcap=None):
    """float64 NumPy: softmax over the visible keys only."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bthd,bhsd->bhts", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(mask[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # a query that sees nothing (padding): NaN, unread
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhts,bhsd->bthd", p / p.sum(-1, keepdims=True), v)


# (batch, columns, heads, kv heads, slots, head dim, window, softcap, query block, key block)
CASES_FULL = [
    (1, 1, 2, 1, 40, 8, None, None, 8, 16),  # a decode-shaped call
    (2, 37, 4, 2, 100, 8, None, None, 16, 32),  # last key block moved back, padded queries
    (3, 200, 6, 2, 300, 16, 20, 5.0, 64, 48),  # window, soft-cap, many skipped blocks
    (2, 130, 4, 4, 130, 8, 7, None, 32, 16),
    (1, 300, 8, 1, 333, 4, None, 2.0, 40, 64),  # multi-query
]


@pytest.mark.parametrize("case", CASES_FULL)
def test_blockwise_equals_the_reference_on_the_full_cache(case):
    b, t, h, hkv, s, d, window, cap, qb, kb = case
    rng = np.random.default_rng(sum(case[:6]))
    q, k, v = _qkv(rng, b, t, h, hkv, s, d)
    pos = _positions(rng, b, t, s)
    mask = ops.Mask(jnp.asarray(pos), None, window)
    ref = ops.reference_attention(q, k, v, mask.dense(s), 0.3, cap)
    got = jax.jit(
        lambda q, k, v, m: ops.blockwise_attention(q, k, v, m, 0.3, cap, q_block=qb, k_block=kb)
    )(q, k, v, mask)
    real = pos >= 0  # padding's output is never read
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], atol=2e-6)
    np.testing.assert_allclose(
        np.asarray(got)[real],
        _float64(q, k, v, np.asarray(mask.dense(s)), 0.3, cap)[real],
        atol=2e-5,
    )
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("columns", [1, 3, 25])
def test_blockwise_equals_the_reference_on_a_ring(columns):
    """A sliding-window ring: R slots holding positions in `p % R` order (some empty, some
    at or past the call's first position: taken back), then the call's own columns."""
    rng = np.random.default_rng(columns)
    b, h, hkv, d, ring, window = 3, 4, 2, 8, 13, 5
    first = np.asarray([20, 3, 0])
    ring_pos = np.full((b, ring), -1, np.int32)
    for r in range(b):
        for p in range(max(0, first[r] - ring), first[r] + 2):  # +2: taken back
            ring_pos[r, p % ring] = p
    pos = np.stack([f + np.arange(columns) for f in first]).astype(np.int32)
    pos[1, : columns // 2] = -1  # left padding
    pos[1, columns // 2 :] = first[1] + np.arange(columns - columns // 2)
    q, k, v = _qkv(rng, b, columns, h, hkv, ring + columns, d)

    mask = ops.Mask(jnp.asarray(pos), layers.ring_keys(jnp.asarray(pos), ring_pos), window)
    dense = np.asarray(layers.ring_mask(jnp.asarray(pos), jnp.asarray(ring_pos), window))
    np.testing.assert_array_equal(np.asarray(mask.dense(ring + columns)), dense)
    got = ops.blockwise_attention(q, k, v, mask, 0.3, 3.0, q_block=4, k_block=8)
    real = pos >= 0
    np.testing.assert_allclose(
        np.asarray(got)[real], _float64(q, k, v, dense, 0.3, 3.0)[real], atol=2e-5
    )


def test_cudnn_path_rolls_padding_and_falls_back_for_offsets():
    """The cuDNN call's own logic (rolling left padding to the end, the causal mask of a
    whole prompt, the window, the fallback for a later chunk), run with jax's XLA
    implementation of the same `dot_product_attention` call, as no GPU is needed."""
    rng = np.random.default_rng(3)
    b, t, h, hkv, s, d = 3, 40, 4, 2, 64, 8
    q, k, v = _qkv(rng, b, t, h, hkv, s, d)
    for window in (None, 5):
        for fresh in (True, False):
            pos = _positions(rng, b, t, s, fresh=fresh)
            mask = ops.Mask(jnp.asarray(pos), None, window)
            got = api.cudnn_attention(q, k, v, mask, 0.3, library="xla")
            want = _float64(q, k, v, np.asarray(mask.dense(s)), 0.3)
            real = pos >= 0
            np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=2e-5)


def test_gradients_through_blockwise_equal_the_reference():
    """Training (`scripts/train_tiny.py`) differentiates through the model's prompt pass:
    through the loops and the skipped blocks' conditionals."""
    rng = np.random.default_rng(5)
    b, t, h, hkv, d = 2, 70, 4, 2, 8
    q, k, v = (jnp.asarray(a) for a in _qkv(rng, b, t, h, hkv, t, d))
    mask = ops.Mask(jnp.asarray(_positions(rng, b, t, t, fresh=True)))

    real = np.asarray(mask.q_pos) >= 0

    def loss(attend):  # over the real queries: padding's output is never read
        return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)) * real[:, :, None, None])

    got = jax.grad(
        loss(lambda q, k, v: ops.blockwise_attention(q, k, v, mask, 0.3, q_block=16, k_block=16)),
        argnums=(0, 1, 2),
    )(q, k, v)
    want = jax.grad(
        loss(lambda q, k, v: ops.reference_attention(q, k, v, mask.dense(t), 0.3)),
        argnums=(0, 1, 2),
    )(q, k, v)
    np.testing.assert_allclose(np.asarray(got[0])[real], np.asarray(want[0])[real], atol=1e-5)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on a GPU only")
def test_cudnn_on_a_gpu_matches_float64():
    rng = np.random.default_rng(4)
    b, t, h, hkv, s, d = 3, 96, 8, 2, 160, 64
    q, k, v = _qkv(rng, b, t, h, hkv, s, d)
    for window in (None, 17):
        pos = _positions(rng, b, t, s, fresh=True)
        mask = ops.Mask(jnp.asarray(pos), None, window)
        args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
        got = jax.jit(lambda q, k, v, m: ops.attention(q, k, v, m, 0.125))(*args, mask)
        want = _float64(q, k, v, np.asarray(mask.dense(s)), 0.125)
        real = pos >= 0
        np.testing.assert_allclose(np.asarray(got, np.float32)[real], want[real], atol=3e-2)


def test_dispatch_picks_one_implementation_per_call():
    kw = dict(head_dim=64, softcap=None, ring=False, deterministic=False)
    assert api.choose(columns=1, dtype=jnp.float32, backend="cpu", **kw) == "decode"
    assert api.choose(columns=9, dtype=jnp.float32, backend="cpu", **kw) == "blockwise"
    assert api.choose(columns=9, dtype=jnp.bfloat16, backend="gpu", **kw) == "cudnn"
    assert api.choose(columns=9, dtype=jnp.float32, backend="gpu", **kw) == "blockwise"
    assert api.choose(columns=9, dtype=jnp.float32, backend="tpu", **kw) == "splash"
    assert api.choose(columns=9, dtype=jnp.bfloat16, backend="tpu", **{**kw, "softcap": 50.0}) == (
        "splash"
    )
    assert api.choose(columns=9, dtype=jnp.bfloat16, backend="tpu", **{**kw, "ring": True}) == (
        "blockwise"
    )
    for change in (dict(softcap=50.0), dict(ring=True)):
        assert api.choose(columns=9, dtype=jnp.bfloat16, backend="gpu", **{**kw, **change}) == (
            "blockwise"
        )
    capped = {**kw, "deterministic": True}
    assert api.choose(columns=9, dtype=jnp.bfloat16, backend="gpu", **capped) == "fixed-order"
    with pytest.raises(ValueError, match="implementation"):
        ops.attention(
            *(jnp.zeros((1, 2, 2, 4)),) * 1,
            *(jnp.zeros((1, 1, 4, 4)),) * 2,
            ops.Mask(jnp.zeros((1, 2), jnp.int32)),
            1.0,
            implementation="flash",
        )


def test_model_info_reports_the_choice():
    model = LlamaModel(_llama_config(16, 64), rngs=nnx.Rngs(0))
    assert model_info(model).attention == "prompt: blockwise; decode: decode"
    gemma = dict(head_dim=128, dtype=jnp.bfloat16, softcap=50.0, windows=(4096, None))
    assert api.describe(deterministic=False, backend="gpu", **gemma) == (
        "prompt: blockwise; decode: decode"
    )
    llama = dict(head_dim=128, dtype=jnp.bfloat16, softcap=None, windows=(4096, None))
    assert api.describe(deterministic=False, backend="gpu", **llama) == (
        "prompt: cudnn (blockwise on sliding-window rings); decode: decode"
    )
    assert api.describe(deterministic=False, backend="tpu", **gemma) == (
        "prompt: splash (blockwise on sliding-window rings); decode: decode"
    )
    assert api.describe(deterministic=True, backend="gpu", **llama) == (
        "prompt: fixed-order; decode: fixed-order"
    )


def _logitloop_model(case: str, seed: int = 0):
    """A logitloop model of `tiny_checkpoints.CASES[case]`'s config, random weights scaled
    up so that attention is far from uniform."""
    import transformers

    config_cls, _, kwargs = CASES[case]
    fields = getattr(transformers, config_cls)(**kwargs).to_dict()
    family = registry.family_for(fields["model_type"])
    model = family.model_class(family.parse_config(HFConfig(fields)), rngs=nnx.Rngs(seed))
    for _, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * 10.0
    return model


def _forward_columns(model, tokens, positions, slots, chunk=None):
    """Every column's logits `[B, T, V]`, the prompt in one pass or `chunk` at a time."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, all_columns=True)

    cache = model.init_cache(tokens.shape[0], slots)
    step = chunk or tokens.shape[1]
    out = []
    for start in range(0, tokens.shape[1], step):
        cols = slice(start, start + step)
        logits, cache = run(state, tokens[:, cols], positions[:, cols], cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize(
    "case",
    [
        "llama",
        "gemma2",
        pytest.param("phi3", marks=pytest.mark.slow),
        pytest.param("gpt2", marks=pytest.mark.slow),
        pytest.param("mistral", marks=pytest.mark.slow),
    ],
)
def test_models_through_blockwise_equal_the_reference(case, monkeypatch):
    """Left-padded prompts in one pass and in chunks (chunked prefill; later chunks attend
    what earlier ones wrote) give the one-einsum attention's logits. Gemma 2 and Mistral
    have sliding windows shorter than the cache (rings) and Gemma 2 soft-capping."""
    model = _logitloop_model(case)
    rng = np.random.default_rng(0)
    width, slots = 40, 64
    tokens = jnp.asarray(rng.integers(0, 150, (2, width)), jnp.int32)
    positions = np.full((2, width), -1, np.int32)
    positions[0, 11:] = np.arange(width - 11)
    positions[1] = np.arange(width)
    positions = jnp.asarray(positions)
    monkeypatch.setattr(blockwise, "K_BLOCK", 8)
    monkeypatch.setattr(blockwise, "Q_BLOCK", 16)
    got = _forward_columns(model, tokens, positions, slots)
    chunked = _forward_columns(model, tokens, positions, slots, chunk=16)
    monkeypatch.setattr(api, "choose", lambda **kw: "reference" if kw["columns"] > 1 else "decode")
    want = _forward_columns(model, tokens, positions, slots)
    real = np.asarray(positions) >= 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(chunked[real], want[real], rtol=1e-4, atol=1e-4)


def _llama_config(hidden, context, layers=2, heads=4, kv_heads=2):
    return LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )


def prompt_pass(model, columns: int, batch: int = 1):
    """A traced prompt pass of `columns` tokens (a cache of as many slots), never run."""
    graphdef, state = nnx.split(model)

    def forward(state, tokens, positions):
        m = nnx.merge(graphdef, state)
        return m(tokens, positions, m.init_cache(batch, columns))[0]

    tokens = jax.ShapeDtypeStruct((batch, columns), jnp.int32)
    return jax.jit(forward).trace(state, tokens, tokens)


def prompt_pass_temp_bytes(model, columns: int) -> int:
    """XLA's temporaries of a compiled prompt pass of `columns` tokens (batch 1), from
    `memory_analysis()`: compiled only, never run."""
    compiled = prompt_pass(model, columns).lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_prompt_pass_temporaries_grow_linearly(monkeypatch):
    """4x the prompt: about 4x the temporaries through the dispatch (16x the scores with the
    one-einsum reference, which the same measurement shows)."""
    model = LlamaModel(_llama_config(64, 2048), rngs=nnx.Rngs(0))
    blocks = prompt_pass_temp_bytes(model, 2048) / prompt_pass_temp_bytes(model, 512)
    assert blocks < 6, blocks
    monkeypatch.setattr(api, "choose", lambda **kw: "reference")
    one_einsum = prompt_pass_temp_bytes(model, 2048) / prompt_pass_temp_bytes(model, 512)
    assert one_einsum > 10, one_einsum


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_models_at_long_prompts_with_the_default_blocks(case, monkeypatch):
    """A prompt of 1100 columns (3 query and key blocks of the default 512) with left
    padding, in one pass and in chunks of 512, against the one-einsum attention."""
    model = _logitloop_model(case)
    rng = np.random.default_rng(1)
    width, slots = 1100, 1200
    tokens = jnp.asarray(rng.integers(0, 150, (2, width)), jnp.int32)
    positions = np.full((2, width), -1, np.int32)
    positions[0, 300:] = np.arange(width - 300)
    positions[1] = np.arange(width)
    positions = jnp.asarray(positions)
    got = _forward_columns(model, tokens, positions, slots)
    chunked = _forward_columns(model, tokens, positions, slots, chunk=512)
    monkeypatch.setattr(api, "choose", lambda **kw: "reference" if kw["columns"] > 1 else "decode")
    want = _forward_columns(model, tokens, positions, slots)
    real = np.asarray(positions) >= 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(chunked[real], want[real], rtol=1e-4, atol=1e-4)
