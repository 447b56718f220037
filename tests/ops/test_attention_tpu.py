"""The TPU path of `logitloop.ops.attention`: jax's splash attention kernel, run in
Pallas's interpreter on CPU against float64, and a prompt pass lowered for a TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.ops import attention as ops
from logitloop.ops.attention import splash
from tests.ops.test_attention import _float64, _positions, _qkv


@pytest.mark.parametrize(
    ("t", "window", "softcap", "fresh"),
    [(40, None, None, True), (130, 7, 3.0, True), (40, None, None, False)],
)
def test_splash_in_interpret_mode_matches_float64(t, window, softcap, fresh):
    """GQA, rolled left padding, columns padded to 128, window and soft-cap; a later
    chunk (`fresh=False`) falls back to blockwise."""
    rng = np.random.default_rng(t)
    b, h, hkv, s, d = 2, 4, 2, 160, 8
    q, k, v = _qkv(rng, b, t, h, hkv, s, d)
    pos = _positions(rng, b, t, s, fresh=fresh)
    mask = ops.Mask(jnp.asarray(pos), None, window)
    got = splash.splash_attention(q, k, v, mask, 0.3, softcap, interpret=True)
    want = _float64(q, k, v, np.asarray(mask.dense(s)), 0.3, softcap)
    real = pos >= 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=2e-5)


# A window longer than the 200-slot cache is a LocalMask; a shorter one makes a ring, which
# takes blockwise.
@pytest.mark.parametrize(
    ("head_dim", "window", "kernel"), [(8, None, True), (128, 256, True), (8, 24, False)]
)
def test_a_prompt_pass_lowers_to_the_kernel_for_tpu(monkeypatch, head_dim, window, kernel):
    """A tiny Llama's prompt pass, with "auto" choosing as on a TPU, lowers for a TPU (from
    this CPU) with the kernel in it (a Pallas TPU call)."""
    from flax import nnx

    from logitloop.models import LlamaConfig, LlamaModel
    from logitloop.ops.attention import api
    from tests.ops.test_attention import prompt_pass

    monkeypatch.setattr(api, "default_backend", lambda: "tpu")
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=2 * head_dim,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        max_position_embeddings=512,
        sliding_windows=(window,) * 2,
    )
    traced = prompt_pass(LlamaModel(config, rngs=nnx.Rngs(0)), 200, batch=2)
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert ("tpu_custom_call" in text) == kernel


@pytest.mark.slow  # 20-35 s on 2 cores: the backward kernels in the interpreter
def test_gradients_through_splash_equal_the_reference():
    """Training on a TPU would differentiate through the kernel's own backward pass."""
    rng = np.random.default_rng(5)
    b, t, h, hkv, d = 2, 40, 4, 2, 8
    q, k, v = (jnp.asarray(a) for a in _qkv(rng, b, t, h, hkv, t, d))
    mask = ops.Mask(jnp.asarray(_positions(rng, b, t, t, fresh=True)))
    real = np.asarray(mask.q_pos) >= 0

    def loss(attend):  # over the real queries: padding's output is never read
        return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)) * real[:, :, None, None])

    kernel = lambda q, k, v: splash.splash_attention(q, k, v, mask, 0.3, 2.0, interpret=True)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    reference = lambda q, k, v: ops.reference_attention(q, k, v, mask.dense(t), 0.3, 2.0)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(np.asarray(got[0])[real], np.asarray(want[0])[real], atol=1e-5)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
