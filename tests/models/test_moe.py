"""The mixture-of-experts MLP against a float64 NumPy reference (both of its code paths,
with and without renormalisation, and exact routing ties), the expert-parallel partition
rule, and the Mixtral / Qwen3-MoE config fields."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from logitloop.models import MoeConfig, config_from_hf
from logitloop.models.moe import MoeBlock
from logitloop.models.partitioning import mesh_spec

E, X, F = 16, 8, 12


def _block(norm_topk_prob: bool, k: int = 2) -> MoeBlock:
    config = MoeConfig(
        model_type="mixtral",
        vocab_size=32,
        hidden_size=E,
        intermediate_size=F,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        num_experts=X,
        num_experts_per_tok=k,
        moe_intermediate_size=F,
        norm_topk_prob=norm_topk_prob,
    )
    # rngs=None: zeros (drawing random weights eagerly is slow); set below
    block = MoeBlock(config, 0, dtype=jnp.float32, rngs=None)
    rng = np.random.default_rng(0)
    for name in ("router", "w_gate", "w_up", "w_down"):
        param = getattr(block, name)
        param.set_value(jnp.asarray(rng.normal(0, 0.5, param[...].shape), jnp.float32))
    return block


def _reference(block: MoeBlock, h: np.ndarray) -> np.ndarray:
    """float64: softmax router, top-k (ties to the lower expert id), SiLU-gated experts."""
    c = block.config
    w = {
        n: np.asarray(getattr(block, n)[...], np.float64)
        for n in ("router", "w_gate", "w_up", "w_down")
    }
    flat = h.reshape(-1, E).astype(np.float64)
    logits = flat @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(flat)
    for n in range(flat.shape[0]):
        chosen = np.argsort(-probs[n], kind="stable")[: c.num_experts_per_tok]
        weights = probs[n, chosen]
        if c.norm_topk_prob:
            weights = weights / weights.sum()
        for j, x in zip(chosen, weights, strict=True):
            gate = flat[n] @ w["w_gate"][j]
            act = gate / (1 + np.exp(-gate))
            out[n] += x * ((act * (flat[n] @ w["w_up"][j])) @ w["w_down"][j])
    return out.reshape(h.shape)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shape", [(3, 1), (5, 1), (2, 6)])  # routed, dense (5*2 >= 8), prefill
def test_mixture_matches_reference(norm_topk_prob, shape):
    block = _block(norm_topk_prob)
    h = np.random.default_rng(sum(shape)).normal(size=(*shape, E)).astype(np.float32)
    got = jax.jit(lambda h: block.mlp(h))(jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(got), _reference(block, h), rtol=1e-5, atol=1e-5)


def test_exact_routing_ties_go_to_the_lower_expert_id():
    block = _block(norm_topk_prob=True, k=3)
    router = np.asarray(block.router[...]).copy()
    router[:, 5] = router[:, 2]  # experts 2 and 5 always score the same
    router[:, 6] = router[:, 2]
    block.router.set_value(jnp.asarray(router))
    h = np.random.default_rng(1).normal(size=(4, 1, E)).astype(np.float32)
    probs = jax.nn.softmax(jnp.asarray(h.reshape(4, E)) @ jnp.asarray(router))
    top = np.argsort(-np.asarray(probs), kind="stable")[:, :3]
    tied_chosen = np.isin(top, [2, 5, 6]).sum(axis=1)
    assert np.any((tied_chosen == 1) | (tied_chosen == 2))  # a tie decides for some row
    for rows in (h[:1], h):  # the routed path (1 row) and the dense one (4 rows)
        got = np.asarray(jax.jit(lambda h: block.mlp(h))(jnp.asarray(rows)))
        np.testing.assert_allclose(got, _reference(block, rows), rtol=1e-5, atol=1e-5)


def test_experts_shard_over_the_model_axis():
    names = ("experts", "embed", "mlp")
    assert mesh_spec(names, (8, E, F), model_size=4) == P("model", None, None)
    # 8 experts do not split 3 ways: the experts' MLP width does.
    assert mesh_spec(names, (8, E, 12), model_size=3) == P(None, None, "model")
    assert mesh_spec(("embed", None), (E, 8), model_size=4) == P(None, None)  # the router


MOE = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)


def test_mixtral_and_qwen3_moe_fields():
    mixtral = config_from_hf(dict(MOE, model_type="mixtral", num_local_experts=4, sliding_window=8))
    assert isinstance(mixtral, MoeConfig)
    assert mixtral.sparse_layers == (True,) * 4 and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == 24 and mixtral.sliding_windows == (8,) * 4
    qwen = config_from_hf(
        dict(
            MOE,
            model_type="qwen3_moe",
            num_experts=4,
            moe_intermediate_size=8,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    assert qwen.sparse_layers == (False, True, False, False)
    assert not qwen.norm_topk_prob and qwen.qk_norm and qwen.moe_intermediate_size == 8


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(num_experts_per_tok=5),
            r"num_experts_per_tok \(5\) must be in \[1, num_experts \(4\)\]",
        ),
        (dict(num_local_experts=None), "requires field 'num_local_experts'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported RoPE type 'yarn'"),
    ],
)
def test_unsupported_mixtral_options_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(dict(MOE, model_type="mixtral", **{"num_local_experts": 4, **fields}))
