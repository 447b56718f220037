"""Converted checkpoints: an Orbax round trip is bit-exact and can restore onto shardings.

Restoring onto a mesh that really partitions the weights (8 CPU devices, in a subprocess,
by the sharding rules and by hand from the logical axis names) is tested in
`tests/sharding/test_sharded_generate.py` (`test_orbax_restore_partitions_weights...`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from logitloop.models import load_pretrained, restore_converted, save_converted

from .tiny_checkpoints import (
    build_hf_model,
    byte_level_bpe,
    jitted_forward,
    left_pad,
    random_prompts,
    save_hf_model,
)

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_bit_exact(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def checkpoint(request, tmp_path_factory):
    folder = save_hf_model(build_hf_model(request.param), tmp_path_factory.mktemp("hf"))
    byte_level_bpe().save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_is_bit_exact(checkpoint, dtype, tmp_path):
    model = load_pretrained(checkpoint, dtype=dtype)
    save_converted(model, tmp_path / "converted")
    restored = restore_converted(tmp_path / "converted")
    assert type(restored) is type(model)
    assert restored.config == model.config
    assert restored.dtype == model.dtype
    jax.tree.map(_assert_bit_exact, _params(model), _params(restored))
    tokens, positions = left_pad(random_prompts(model.config.vocab_size, [4, 7], seed=0), 8)
    tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
    want, _ = jitted_forward(model)(tokens, positions, model.init_cache(2, 8))
    got, _ = jitted_forward(restored)(tokens, positions, restored.init_cache(2, 8))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert restored.tokenizer is not None
    assert restored.tokenizer.eos_token_ids == model.tokenizer.eos_token_ids
    assert restored.tokenizer.encode("déjà vu") == model.tokenizer.encode("déjà vu")


def test_restore_onto_one_sharding(checkpoint, tmp_path):
    model = load_pretrained(checkpoint)
    save_converted(model, tmp_path / "converted")
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    replicated = NamedSharding(mesh, PartitionSpec())
    restored = restore_converted(tmp_path / "converted", sharding=replicated)
    for leaf in jax.tree.leaves(_params(restored)):
        assert leaf.sharding == replicated
    jax.tree.map(_assert_bit_exact, _params(model), _params(restored))


def test_save_refuses_to_overwrite(checkpoint, tmp_path):
    model = load_pretrained(checkpoint)
    save_converted(model, tmp_path / "converted")
    with pytest.raises(FileExistsError):
        save_converted(model, tmp_path / "converted")


def test_restore_from_a_non_converted_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="converted model"):
        restore_converted(tmp_path)
