"""Write a Llama-family model as an ordinary Hugging Face checkpoint folder.

The inverse of `load_pretrained` for `LlamaModel`: `config.json`, `model.safetensors` and,
when given, `tokenizer.json`, `tokenizer_config.json` (e.g. with a `chat_template`) and
`generation_config.json`, in the layout that
`transformers.AutoModelForCausalLM.from_pretrained` reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.flax import save_file

from logitloop.models import quantization
from logitloop.models.config import LlamaConfig
from logitloop.models.llama import LlamaModel, checkpoint_tensors


def hf_config(config: LlamaConfig, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` dictionary of a Llama-family config."""
    c = config
    if c.model_type != "llama":
        raise ValueError(f"export supports model_type 'llama', got {c.model_type!r}")
    eos = list(c.eos_token_id)
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "hidden_act": c.hidden_act,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.qkv_bias,
        "mlp_bias": c.mlp_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": torch_dtype,
    }
    if c.rope.rope_type != "default":
        raise ValueError("export does not write RoPE scaling")
    return out


def _to_checkpoint(name: str, value: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """Parameter layout -> the checkpoint's torch layout (inverse of the loader's transform)."""
    c = config
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):  # [E, n, D]
        return value.reshape(c.hidden_size, -1).T
    if name.endswith("o_proj.weight"):  # [H, D, E]
        return value.reshape(-1, c.hidden_size).T
    if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return value.T
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return value.reshape(-1)
    return value


def save_pretrained(
    model: LlamaModel,
    folder: str | os.PathLike,
    *,
    dtype: Any = np.float32,
    tokenizer_json: str | os.PathLike | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` as a Hugging Face checkpoint folder and return its path.

    A quantized model (`load_pretrained(quantize=...)`) is written as its dequantized
    float weights (values times scales, what its products compute), in `dtype`: a folder
    that transformers and vLLM load as an ordinary float checkpoint and that gives the
    quantized model's logits, not a smaller one (neither reads Qwix's arrays).
    `config.json` says so under `logitloop_quantization` (the format, group size and
    whether the vocabulary tables were quantized), a key both ignore; it is not
    `quantization_config`, which would ask them for a quantization method.
    `orbax_io.save_converted` keeps the integer values and scales instead."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {}
    for name, spec in checkpoint_tensors(config).items():
        node: Any = model
        for key in spec.target:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        value = node[...]
        if quantization.is_quantized(value):
            value = quantization.dequantize(value)
        value = np.asarray(value, np.float32)
        out = np.ascontiguousarray(_to_checkpoint(name, value, config))
        if out.shape != spec.shape:
            raise AssertionError(f"{name}: exported shape {out.shape} != {spec.shape}")
        tensors[name] = jnp.asarray(out, dtype)
    torch_dtype = jnp.dtype(dtype).name
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_config(config, torch_dtype=torch_dtype)
    quantized = quantization.storage_record(model)
    if quantized is not None:
        hf["logitloop_quantization"] = {
            "format": quantized["format"],
            "group_size": quantized["group_size"],
            "embedding": quantized["embedding"],
            "note": "the weights are the dequantized values of a quantized logitloop model "
            "(values times scales), stored in torch_dtype: a float checkpoint",
        }
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(
            json.dumps(generation_config, indent=2) + "\n"
        )
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(Path(tokenizer_json).read_text())
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return folder
