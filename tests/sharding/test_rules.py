"""The logical-axis rules (no devices needed: abstract models and plain specs)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from logitloop.models import GPT2Config, LlamaConfig
from logitloop.models.loading import abstract_model
from logitloop.models.partitioning import mesh_spec, partition_specs


def test_mesh_spec_maps_model_parallel_names():
    assert mesh_spec(("embed", "heads", "head_dim"), (64, 8, 8), 4) == P(None, "model", None)
    assert mesh_spec(("vocab", "embed"), (256, 64), 8) == P("model", None)
    assert mesh_spec(("embed", "mlp"), (64, 128), 4) == P(None, "model")
    assert mesh_spec(("embed",), (64,), 4) == P(None)


def test_mesh_spec_replicates_what_does_not_divide():
    assert mesh_spec(("embed", "kv_heads", "head_dim"), (64, 4, 8), 8) == P(None, None, None)
    assert mesh_spec(("vocab", "embed"), (250, 64), 4) == P(None, None)


def test_mesh_spec_uses_the_model_axis_once_and_only_when_it_splits():
    assert mesh_spec(("heads", "mlp"), (8, 8), 4) == P("model", None)
    assert mesh_spec(("heads",), (8,), 1) == P(None)
    assert mesh_spec(None, (3, 3), 4) == P(None, None)


def _specs(model, size):
    return nnx.to_pure_dict(partition_specs(model, size))


def test_llama_parameters():
    config = LlamaConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    specs = _specs(abstract_model(config, jnp.float32), 4)
    layer = specs["layers"][0]
    assert layer["wq"] == P(None, "model", None)
    assert layer["wk"] == P(None, None, None)  # 2 kv heads over 4: replicated
    assert layer["wo"] == P("model", None, None)
    assert layer["w_gate"] == P(None, "model")
    assert layer["w_down"] == P("model", None)
    assert layer["attn_norm"] == P(None)
    assert specs["embedding"] == P(None, None)  # vocab 250 over 4: replicated


def test_gpt2_parameters():
    config = GPT2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        max_position_embeddings=64,
    )
    specs = _specs(abstract_model(config, jnp.float32), 2)
    assert specs["wte"] == P("model", None)
    assert specs["wpe"] == P(None, None)
    block = specs["layers"][0]
    assert block["w_qkv"] == P(None, None, "model", None)  # the unnamed q/k/v axis stays whole
    assert block["b_fc"] == P("model")


def test_plain_pytrees_are_replicated():
    specs = partition_specs({"w": jnp.zeros((8, 4))}, 4)
    assert specs == {"w": P(None, None)}
