"""`load_pretrained`: sharded files, dtypes, tokenizers, and every kind of bad checkpoint."""

from __future__ import annotations

import copy
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from logitloop.models import Tokenizer, load_pretrained
from logitloop.models import loading as loading_module

from .tiny_checkpoints import (
    build_hf_model,
    byte_level_bpe,
    jitted_forward,
    left_pad,
    random_prompts,
    save_hf_model,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_llama():
    return build_hf_model("llama", seed=5)


@pytest.fixture(scope="module")
def llama_dir(hf_llama, tmp_path_factory):
    return save_hf_model(hf_llama, tmp_path_factory.mktemp("llama"))


@pytest.fixture
def bad_dir(llama_dir, tmp_path):
    """A fresh copy of the good checkpoint, for a test to damage."""
    return shutil.copytree(llama_dir, tmp_path / "ckpt")


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _logits(model, prompts, bucket=12):
    tokens, positions = left_pad(prompts, bucket)
    cache = model.init_cache(len(prompts), bucket)
    logits, _ = jitted_forward(model)(jnp.asarray(tokens), jnp.asarray(positions), cache)
    return np.asarray(logits)


def _rewrite(folder, edit):
    """Apply `edit(dict of numpy tensors)` to model.safetensors in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


# --- sharded and single-file checkpoints ---------------------------------------------


def test_sharded_checkpoint_loads_identically(hf_llama, llama_dir, tmp_path):
    sharded = save_hf_model(hf_llama, tmp_path / "sharded", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    single, split = load_pretrained(llama_dir), load_pretrained(sharded)
    jax.tree.map(np.testing.assert_array_equal, _params(single), _params(split))
    prompts = random_prompts(single.config.vocab_size, [4, 9], seed=0)
    np.testing.assert_array_equal(_logits(single, prompts), _logits(split, prompts))


def test_index_naming_a_missing_shard_is_an_error(hf_llama, tmp_path):
    sharded = save_hf_model(hf_llama, tmp_path / "sharded", max_shard_size="50KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(ValueError, match=re.escape(victim.name)):
        load_pretrained(sharded)


def test_gpt2_checkpoint_without_transformer_prefix_and_with_mask_buffers(tmp_path):
    # The original OpenAI-converted GPT-2 files have bare names and causal-mask buffers.
    hf = build_hf_model("gpt2")
    modern = save_hf_model(hf, tmp_path / "modern")
    legacy = shutil.copytree(modern, tmp_path / "legacy")
    tensors = load_file(legacy / "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
    save_file(tensors, legacy / "model.safetensors")
    jax.tree.map(
        np.testing.assert_array_equal,
        _params(load_pretrained(modern)),
        _params(load_pretrained(legacy)),
    )


# --- dtypes ---------------------------------------------------------------------------


def _logits_every_position(model, prompts, bucket=12) -> np.ndarray:
    """`[sum(len(p)), V]`: the logits after every prefix of every prompt, prompt-major (the
    rows of HF's `logits[0]` of each prompt, concatenated), from one batched call."""
    return _logits(model, [p[:i] for p in prompts for i in range(1, len(p) + 1)], bucket)


def _hf_logits_every_position(hf, prompts) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([hf(torch.tensor([p])).logits[0].float().numpy() for p in prompts])


def test_float32_checkpoint_loaded_as_bfloat16(hf_llama, llama_dir):
    full = load_pretrained(llama_dir)
    half = load_pretrained(llama_dir, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(_params(half)))
    assert half.init_cache(1, 4)[0]["k"].dtype == jnp.bfloat16
    # Each weight is its float32 value rounded to bfloat16 (to nearest even), bit for bit.
    jax.tree.map(
        lambda h, f: np.testing.assert_array_equal(
            np.asarray(h).view(np.int16),
            torch.from_numpy(np.array(f)).to(torch.bfloat16).view(torch.int16).numpy(),
        ),
        _params(half),
        _params(full),
    )
    prompts = random_prompts(full.config.vocab_size, [6, 11], seed=4)
    # float32: transformers' float32 logits to float32 rounding, at every position.
    want = _hf_logits_every_position(hf_llama, prompts)
    got = _logits_every_position(full, prompts)
    assert got.shape == want.shape == (17, full.config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    # bfloat16: transformers run in bfloat16 on the same checkpoint. The two round their
    # bfloat16 activations at different points (up to ~2.5% of the largest logit here;
    # logitloop's prompt attention sums its blocks in float32), so they pick the same
    # argmax wherever transformers' top two logits are further apart than that rounding,
    # which is most positions.
    hf_half = copy.deepcopy(hf_llama).to(torch.bfloat16)
    want = _hf_logits_every_position(hf_half, prompts)
    got = _logits_every_position(half, prompts)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())
    top_two = np.sort(want, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 2 * np.max(np.abs(got - want))
    assert clear.mean() >= 0.5
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_bfloat16_checkpoint_keeps_its_dtype_and_matches_hf(tmp_path):
    hf = build_hf_model("qwen3", seed=7).to(torch.bfloat16)
    folder = save_hf_model(hf, tmp_path / "bf16")
    model = load_pretrained(folder)
    assert model.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(_params(model)))
    prompts = random_prompts(model.config.vocab_size, [5, 10], seed=8)
    got = _logits(model, prompts)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].float().numpy()
        np.testing.assert_allclose(got[row], want, rtol=0, atol=0.05 * np.abs(want).max())

    # Upcasting on load gives exactly the stored bf16 values in float32.
    upcast = load_pretrained(folder, dtype="float32")
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b.astype(jnp.float32)),
        _params(upcast),
        _params(model),
    )


def test_unsupported_dtype_argument(llama_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(llama_dir, dtype=jnp.int8)


# --- bad checkpoints: each error names the file and the tensor ------------------------


def test_unknown_model_type(bad_dir):
    config = json.loads((bad_dir / "config.json").read_text())
    config["model_type"] = "bert"
    (bad_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*'bert'"):
        load_pretrained(bad_dir)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_json_nested_past_the_parser_is_named(bad_dir, name):
    (bad_dir / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=rf"{name}: not valid JSON: nested too deeply"):
        load_pretrained(bad_dir)


def test_unsupported_rope_type(bad_dir):
    config = json.loads((bad_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (bad_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*RoPE type 'dynamic'"):
        load_pretrained(bad_dir)


def test_missing_tensor(bad_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(bad_dir, lambda t: t.pop(name))
    with pytest.raises(
        ValueError, match=rf"model\.safetensors.*missing tensor '{re.escape(name)}'"
    ):
        load_pretrained(bad_dir)


def test_unexpected_tensor(bad_dir):
    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(bad_dir, lambda t: t.update({name: np.zeros((4, 4), np.float32)}))
    with pytest.raises(
        ValueError, match=rf"model\.safetensors.*unexpected tensor '{re.escape(name)}'"
    ):
        load_pretrained(bad_dir)


def test_wrong_shape(bad_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(bad_dir, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
    with pytest.raises(
        ValueError, match=rf"model\.safetensors.*'{re.escape(name)}' has shape \(64, 64\)"
    ):
        load_pretrained(bad_dir)


def test_wrong_dtype(bad_dir):
    name = "model.norm.weight"
    _rewrite(bad_dir, lambda t: t.update({name: np.ones(t[name].shape, np.int32)}))
    with pytest.raises(ValueError, match=rf"model\.safetensors.*'{re.escape(name)}' has dtype I32"):
        load_pretrained(bad_dir)


def test_truncated_file(bad_dir):
    path = bad_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors.*tensor '[^']+'.*truncated"):
        load_pretrained(bad_dir)


def test_file_cut_inside_its_header(bad_dir):
    path = bad_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"model\.safetensors.*unreadable"):
        load_pretrained(bad_dir)


def test_missing_weights_file(bad_dir):
    (bad_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(bad_dir)


# --- config, tokenizer and the shipped model -------------------------------------------


def test_generation_config_eos_ids_and_tokenizer_are_attached(bad_dir):
    assert load_pretrained(bad_dir).tokenizer is None
    generation = json.loads((bad_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 5]
    (bad_dir / "generation_config.json").write_text(json.dumps(generation))
    byte_level_bpe().save(str(bad_dir / "tokenizer.json"))
    model = load_pretrained(bad_dir)
    assert model.config.eos_token_id == (2, 5)
    assert model.config.bos_token_id == 1
    assert isinstance(model.tokenizer, Tokenizer)
    assert model.tokenizer.eos_token_ids == (2, 5)
    assert model.tokenizer.decode(model.tokenizer.encode("fox jumps")) == "fox jumps"


def test_shipped_model_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(loading_module, "SHIPPED_MODEL_DIR", tmp_path / "tiny")
    with pytest.raises(FileNotFoundError, match="shipped model"):
        load_pretrained()


def test_no_path_loads_the_shipped_folder(monkeypatch, llama_dir):
    monkeypatch.setattr(loading_module, "SHIPPED_MODEL_DIR", llama_dir)
    model = load_pretrained()
    jax.tree.map(np.testing.assert_array_equal, _params(model), _params(load_pretrained(llama_dir)))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_pretrained(tmp_path / "nowhere")
