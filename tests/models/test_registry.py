"""The model registry: every model_type maps to its family, and a family registered from
outside the package loads, restores and generates with no change to the loading code."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import logitloop as ll
from logitloop.models import (
    DecoderModel,
    GemmaConfig,
    GemmaModel,
    GPT2Config,
    GPT2Model,
    LlamaConfig,
    LlamaModel,
    ModelFamily,
    MoeConfig,
    MoeModel,
    family_for,
    load_pretrained,
    register,
    registry,
    restore_converted,
    save_converted,
)
from logitloop.models import layers as model_layers
from logitloop.models.layers import CheckpointTensor


def test_every_hf_model_type_maps_to_its_architecture():
    expected = {
        "gpt2": (GPT2Config, GPT2Model),
        "llama": (LlamaConfig, LlamaModel),
        "mistral": (LlamaConfig, LlamaModel),
        "qwen2": (LlamaConfig, LlamaModel),
        "qwen3": (LlamaConfig, LlamaModel),
        "gemma2": (GemmaConfig, GemmaModel),
        "gemma3_text": (GemmaConfig, GemmaModel),
        "gemma3": (GemmaConfig, GemmaModel),
        "phi3": (LlamaConfig, LlamaModel),
        "mixtral": (MoeConfig, MoeModel),
        "qwen3_moe": (MoeConfig, MoeModel),
    }
    assert set(registry.model_types()) == set(expected)
    for model_type, (config_class, model_class) in expected.items():
        family = family_for(model_type)
        assert (family.config_class, family.model_class) == (config_class, model_class)
    with pytest.raises(ValueError, match="unsupported model_type 'bert'; supported: .*gpt2"):
        family_for("bert")


# A family the package does not know: the next token's logits depend on the last token only,
# `(embedding[t] + shift) * scale @ head`, so greedy decoding has a closed form.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
    model_type: str = "toy"
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    sliding_windows: tuple[int | None, ...] = (None,)
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None


class ToyBlock(nnx.Module):
    def __init__(self, config: ToyConfig, *, dtype, rngs: nnx.Rngs):
        self.shift = model_layers.param(rngs, (config.hidden_size,), dtype, ("embed",))

    def __call__(self, x, positions, kv):
        # It reads nothing back, but writes its layer's keys and values, as every layer of
        # a model's KVSpec does once a pass (`ll.attention`, logitloop.models.kv).
        h = x[:, :, None, :2]  # [B, T, 1 head, head_dim 2]
        _, kv = ll.attention(h, h, h, kv, layer=0)
        return x + self.shift[...], kv


class ToyModel(DecoderModel):
    def __init__(self, config: ToyConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype)
        e, v = config.hidden_size, config.vocab_size
        self.embedding = model_layers.param(rngs, (v, e), dtype, ("vocab", "embed"))
        self.layers = nnx.List([ToyBlock(config, dtype=dtype, rngs=rngs)])
        self.scale = model_layers.param(rngs, (e,), dtype, ("embed",))
        self.head = model_layers.param(rngs, (v, e), dtype, ("vocab", "embed"))

    def embed(self, tokens, positions):
        return jnp.take(self.embedding[...], tokens, axis=0)

    def output_norm(self, x):
        return x * self.scale[...]

    def head_weight(self):
        return self.head[...]


def toy_checkpoint_tensors(config: ToyConfig) -> dict[str, CheckpointTensor]:
    e, v = config.hidden_size, config.vocab_size
    return {
        "tok.weight": CheckpointTensor(("embedding",), (v, e)),
        "blocks.0.shift": CheckpointTensor(("layers", 0, "shift"), (e,)),
        "norm.scale": CheckpointTensor(("scale",), (e,)),
        "out.weight": CheckpointTensor(("head",), (e, v), lambda w: w.T),  # stored [E, V]
    }


def toy_config_from_hf(hf) -> ToyConfig:
    return ToyConfig(
        vocab_size=int(hf.need("vocab_size")),
        hidden_size=int(hf.need("d_model")),
        max_position_embeddings=int(hf.need("n_ctx")),
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
    )


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # undone after
    return register(
        ModelFamily(
            model_type="toy",
            config_class=ToyConfig,
            parse_config=toy_config_from_hf,
            model_class=ToyModel,
            checkpoint_tensors=toy_checkpoint_tensors,
            checkpoint_name=lambda name: name.removeprefix("toy."),
        )
    )


@pytest.fixture
def toy_folder(tmp_path):
    rng = np.random.default_rng(11)
    v, e = 13, 6
    weights = {
        "toy.tok.weight": rng.normal(size=(v, e)).astype(np.float32),
        "toy.blocks.0.shift": rng.normal(size=(e,)).astype(np.float32),
        "toy.norm.scale": rng.normal(size=(e,)).astype(np.float32),
        "toy.out.weight": rng.normal(size=(e, v)).astype(np.float32),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = {"model_type": "toy", "vocab_size": v, "d_model": e, "n_ctx": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    w = {k.removeprefix("toy."): x.astype(np.float64) for k, x in weights.items()}
    # float64 reference: next-token logits for every last token, [V, V]
    reference = (w["tok.weight"] + w["blocks.0.shift"]) * w["norm.scale"] @ w["out.weight"]
    return tmp_path, reference


def test_a_registered_family_loads_and_generates(toy_family, toy_folder):
    folder, reference = toy_folder
    model = load_pretrained(folder)
    assert type(model) is ToyModel
    assert model.config.eos_token_id == (3, 4)

    tokens = jnp.asarray([[5, 0, 9], [1, 2, 12]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32)
    logits, _ = model(tokens, positions, model.init_cache(2, 8))
    np.testing.assert_allclose(np.asarray(logits), reference[[9, 12]], rtol=1e-5, atol=1e-5)

    params = ll.SamplingParams.create(1, temperature=0.0, max_tokens=6)
    out = ll.generate(model, [[7, 2]], params, ignore_eos=True).token_ids[0]
    want, last = [], 2
    for _ in range(6):
        last = int(np.argmax(reference[last]))
        want.append(last)
    assert list(out) == want


def test_a_registered_family_round_trips_through_orbax(toy_family, toy_folder, tmp_path):
    model = load_pretrained(toy_folder[0])
    save_converted(model, tmp_path / "converted")
    restored = restore_converted(tmp_path / "converted")
    assert type(restored) is ToyModel
    assert restored.config == model.config  # tuples rebuilt from the JSON lists
    for a, b in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(restored, nnx.Param)),
        strict=True,
    ):
        assert a[0] == b[0]
        np.testing.assert_array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]))


def test_a_model_type_registers_once(toy_family):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register(dataclasses.replace(toy_family))
