"""Load a Hugging Face checkpoint folder into a Flax NNX model.

A folder holds `config.json`, the weights (`model.safetensors`, or
`model.safetensors.index.json` and the shards it names), and optionally
`generation_config.json` and `tokenizer.json`. A model named by its Hugging Face Hub repo id
is that repo's snapshot folder in the Hugging Face cache (`hub.py` finds or downloads it).

The model is first built abstractly (`nnx.eval_shape`: shapes only, no memory); each
checkpoint tensor is then read on its own, checked, converted and placed, so the weights
are never held twice.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from functools import reduce
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from logitloop.models import hub, quantization, registry
from logitloop.models.config import ModelConfig, config_from_hf
from logitloop.models.decoder import DecoderModel
from logitloop.models.json_file import read_json as _read_json
from logitloop.models.layers import CheckpointTensor
from logitloop.models.tokenizer import Tokenizer

SHIPPED_MODEL_DIR = Path(__file__).resolve().parent / "tiny"

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# safetensors dtype codes of the floating types weights may be stored in.
_FLOAT_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}

Model = DecoderModel


def build_model(config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None) -> Model:
    """A randomly initialised model for `config` (use under `nnx.eval_shape` for shapes)."""
    rngs = nnx.Rngs(0) if rngs is None else rngs
    model_class = registry.family_for(config.model_type).model_class
    return model_class(config, dtype=dtype, rngs=rngs)


def abstract_model(config: ModelConfig, dtype) -> Model:
    """The model with `jax.ShapeDtypeStruct` in place of every parameter."""
    model_class = registry.family_for(config.model_type).model_class
    # rngs=None: zeros, not random draws (see `layers.param`).
    return nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=None))


def load_pretrained(
    path: str | os.PathLike | None = None,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    dtype=None,
    quantize: str | None = None,
    group_size: int | None = None,
    quantize_embedding: bool = False,
) -> Model:
    """Load a Hugging Face checkpoint: a folder, or a model on the Hub by its name.

    Args:
      path: the folder, or a Hugging Face Hub repo id ("org/name"), found in the Hugging
        Face cache or downloaded into it (`logitloop.models.hub`: only the config, tokenizer,
        chat template and safetensors files; `HF_HUB_OFFLINE=1` reads the cache alone);
        None loads the small model shipped in `logitloop/models/tiny/`.
      revision: with a repo id, its branch, tag or commit hash (default "main").
      token: with a repo id, an access token for a gated or private repo (default: the
        saved one, `hf auth login`, or `HF_TOKEN`).
      cache_dir: with a repo id, the Hugging Face cache folder (default: `HF_HUB_CACHE`).
      dtype: parameter (and compute) dtype, one of float32, bfloat16, float16. None keeps
        the checkpoint's own floating dtype (that of its token embedding).
      quantize: None (float weights), "int8" or "fp8" (e4m3; per output channel) or
        "int4" (per group of `group_size` contraction entries): the attention and MLP
        projections as Qwix quantized arrays (`logitloop.models.quantization`; needs the
        extra `quant`).
        The embedding, LM head, norms and biases stay in `dtype`. Each projection is
        quantized as it is read (no whole float copy); every weight's shape is checked
        against the format before the first tensor is read.
      group_size: int4's group along each weight's contraction; None (the default): the
        largest of 128, 64, 32 that divides every quantized weight's contraction
        (`quantization.GROUP_SIZES`; `model.quantization.describe()` names it). A given
        size that does not divide a contraction is refused, naming the weight.
      quantize_embedding: with `quantize`, the token embedding and LM head too (one table
        when tied), a scale per vocabulary row (int4: per row and group of the embedding
        axis); False keeps them in `dtype`, as vLLM and torchao do by default.

    Returns:
      The model its `model_type` is registered with (`logitloop.models.registry`), e.g. a
      `LlamaModel` or `GPT2Model`, with `model.tokenizer` set when the folder has a
      `tokenizer.json`, and `model.checkpoint_dir` the folder it was read from (a repo's
      snapshot in the cache; where `logitloop.conversation` finds the chat template and
      the generation defaults).

    Raises:
      FileNotFoundError: the folder, its config.json or its weights are missing; no such
        repo or revision on the Hub; offline and not in the cache.
      PermissionError: a gated repo the token gives no access to.
      ValueError: a repo without safetensors weights or asking for remote code; naming
        the file and, where there is one, the tensor: an unsupported
        architecture, a missing, unexpected or misshapen tensor, a tensor of non-floating
        dtype, or an unreadable (truncated, corrupt) safetensors file.
    """
    dtype = None if dtype is None else _check_dtype(dtype)
    quantize_spec = quantization.check_quantize(quantize, group_size, quantize_embedding)
    folder = _resolve_folder(path, revision=revision, token=token, cache_dir=cache_dir)
    config_path = folder / "config.json"
    hf_config = _read_json(config_path)
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    config = config_from_hf(
        hf_config,
        generation_config=generation,
        source=str(config_path),
        generation_source=str(generation_path),
    )

    locations = _tensor_locations(folder)  # tensor name -> file holding it
    expected, ignored, rename = _checkpoint_layout(config)
    if dtype is None:
        dtype = _checkpoint_dtype(locations, rename, expected)

    model = abstract_model(config, dtype)
    # Checked on the abstract model before any tensor is read: a refused int4 group size
    # leaves no half-quantized model behind.
    quantized = {}
    if quantize_spec is not None:
        quantize_spec, quantized = quantization.plan(model, quantize_spec)

    def store(target: tuple, value: jax.Array) -> None:
        # Quantized as it is read, so the float copy of the whole model never exists.
        if target in quantized:
            value = quantization.quantize_param(target, value, quantized[target], quantize_spec)
        reduce(_child, target, model).set_value(value)

    _fill_parameters(model, locations, expected, ignored, rename, dtype, store)
    if quantize_spec is not None:
        quantization.record(model, quantize_spec, quantized)

    tokenizer_path = folder / "tokenizer.json"
    if tokenizer_path.is_file():
        model.tokenizer = Tokenizer.from_file(
            tokenizer_path,
            bos_token_id=config.bos_token_id,
            eos_token_ids=config.eos_token_id or None,
        )
    model.checkpoint_dir = folder
    return model


def _resolve_folder(path: str | os.PathLike | None, **hub_options) -> Path:
    if path is None:
        if not (SHIPPED_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model is missing: {SHIPPED_MODEL_DIR} has no config.json "
                "(it is produced by the training script in scripts/); pass a checkpoint "
                "folder to load_pretrained(path) instead"
            )
        if hub_options.get("revision") is not None:
            raise ValueError("revision= needs a Hugging Face Hub repo id as the path")
        return SHIPPED_MODEL_DIR
    return hub.model_folder(path, **hub_options)


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it.

    Each file's header is read (and so validated) here, before any tensor is loaded.
    """
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: missing 'weight_map'")
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index_path}: names shard {file.name}, which does not exist")
    elif single.is_file():
        files = [single]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    locations: dict[str, Path] = {}
    for file in files:
        for name in _safetensors_keys(file):
            if name in locations:
                raise ValueError(f"{file}: tensor {name!r} is also stored in {locations[name]}")
            locations[name] = file
    return locations


def _safetensors_keys(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="flax") as f:
            return list(f.keys())
    except Exception as e:  # SafetensorError is not exported under a stable name
        raise ValueError(
            f"{file}: unreadable safetensors file ({_describe_damage(file, e)})"
        ) from e


def _describe_damage(file: Path, error: Exception) -> str:
    """Why safetensors refused `file`, naming the first tensor cut off when truncated."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                return f"file is {size} bytes, too short for a header; {error}"
            (header_len,) = struct.unpack("<Q", raw_len)
            if 8 + header_len > size:
                return f"header claims {header_len} bytes but the file is {size}; {error}"
            header = json.loads(f.read(header_len))
        data_len = size - 8 - header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            end = info["data_offsets"][1]
            if end > data_len:
                return (
                    f"tensor {name!r} ends at byte {end} of the data but the file holds "
                    f"only {data_len}: truncated; {error}"
                )
    except Exception:  # a header too damaged to parse: report safetensors' own reason
        pass
    return str(error)


def _checkpoint_layout(config: ModelConfig):
    """(expected tensors, is-ignored predicate, name normaliser) for the architecture."""
    family = registry.family_for(config.model_type)
    return (
        family.checkpoint_tensors(config),
        lambda name: family.is_ignored_tensor(name, config),
        family.checkpoint_name,
    )


def _check_dtype(dtype) -> jnp.dtype:
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}") from e
    if resolved.name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return resolved


def _checkpoint_dtype(locations, rename, expected) -> jnp.dtype:
    # The checkpoint's own precision: the dtype its token embedding is stored in (every
    # family lists the embedding first in its checkpoint_tensors).
    embedding_target = next(iter(expected.values())).target
    for name, file in locations.items():
        spec = expected.get(rename(name))
        if spec is not None and spec.target == embedding_target:
            with safe_open(file, framework="flax") as f:
                code = f.get_slice(name).get_dtype()
            if code in ("F16", "BF16"):
                return jnp.dtype(_FLOAT_CODES[code])
            return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.float32)  # no embedding: _fill_parameters reports it missing


def _fill_parameters(
    model: Model,
    locations: Mapping[str, Path],
    expected: Mapping[str, CheckpointTensor],
    ignored,
    rename,
    dtype: jnp.dtype,
    store: Callable[[tuple, jax.Array], None],
) -> None:
    """Read, check, convert and place (`store(target, value)`) every checkpoint tensor,
    one at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, file in locations.items():
        by_file.setdefault(file, []).append(name)
    filled: set[str] = set()
    stacks: dict[tuple, dict[int, jax.Array]] = {}
    for file, names in by_file.items():
        try:
            handle = safe_open(file, framework="flax")
        except Exception as e:
            raise ValueError(f"{file}: unreadable safetensors file ({e})") from e
        with handle as f:
            for name in names:
                key = rename(name)
                spec = expected.get(key)
                if spec is None:
                    if ignored(key):
                        continue
                    raise ValueError(f"{file}: unexpected tensor {name!r} for this architecture")
                if key in filled:
                    raise ValueError(f"{file}: tensor {name!r} is stored twice")
                view = f.get_slice(name)
                code = view.get_dtype()
                if code not in _FLOAT_CODES:
                    raise ValueError(
                        f"{file}: tensor {name!r} has dtype {code}; weights must be floating "
                        f"point ({', '.join(_FLOAT_CODES)})"
                    )
                shape = tuple(view.get_shape())
                if shape != spec.shape:
                    raise ValueError(
                        f"{file}: tensor {name!r} has shape {shape}, expected {spec.shape}"
                    )
                try:
                    value = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from e
                value = spec.transform(value.astype(dtype))
                for target, part in spec.placements(value):
                    if spec.stack_index is None:
                        store(tuple(target), part)
                    else:  # placed once all of its slices are read
                        stacks.setdefault(target, {})[spec.stack_index] = part
                filled.add(key)
    missing = [name for name in expected if name not in filled]
    if missing:
        where = ", ".join(sorted({str(p) for p in by_file})) or "(no weight files)"
        raise ValueError(
            f"{where}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for target, parts in stacks.items():
        store(tuple(target), jnp.stack([parts[i] for i in sorted(parts)]))
    # Every checkpoint tensor was placed; a parameter still abstract now would mean the
    # architecture's checkpoint_tensors() forgot it, a bug here rather than in the file.
    unfilled = [
        path
        for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if isinstance(value[...], jax.ShapeDtypeStruct)
    ]
    if unfilled:
        raise RuntimeError(f"parameters with no checkpoint tensor mapped to them: {unfilled}")


def _child(node: Any, key: str | int) -> Any:
    return node[key] if isinstance(key, int) else getattr(node, key)
