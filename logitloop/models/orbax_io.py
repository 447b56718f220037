"""Save and restore converted models with Orbax.

A converted-model directory holds:
  state/                 the parameters, an Orbax (OCDBT) checkpoint of the pure-dict state
  logitloop_model.json   the architecture config and parameter dtype
  tokenizer.json         when the model carries a tokenizer (with its BOS/EOS ids in the
                         JSON file above)

Orbax reads each array straight onto the requested devices, so a restore can lay weights
over a mesh without first gathering them on one device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx

from logitloop.models import quantization
from logitloop.models.config import ModelConfig, config_from_dict, config_to_dict
from logitloop.models.loading import Model, abstract_model
from logitloop.models.partitioning import param_shardings
from logitloop.models.tokenizer import Tokenizer

_META_FILE = "logitloop_model.json"
_STATE_DIR = "state"
_TOKENIZER_FILE = "tokenizer.json"
_FORMAT_VERSION = 1


def save_converted(model: Model, directory: str | os.PathLike) -> None:
    """Write `model` (parameters, config, tokenizer) to a new directory.

    Raises:
      FileExistsError: `directory` already holds a converted model.
    """
    directory = Path(directory).absolute()
    if (directory / _STATE_DIR).exists() or (directory / _META_FILE).exists():
        raise FileExistsError(f"{directory} already holds a converted model")
    directory.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp  # imported when used: it takes a quarter second

    state = quantization.to_storable(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    # Uncompressed: float weights barely compress, and zstd doubled the restore time
    # (scripts/bench_loading.py).
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save(directory / _STATE_DIR, args=ocp.args.PyTreeSave(state))  # synchronous

    meta: dict[str, Any] = {
        "format_version": _FORMAT_VERSION,
        "dtype": jnp.dtype(model.dtype).name,
        "config": config_to_dict(model.config),
        "tokenizer": None,
        # None for float weights; else the format and its storage version (checked on
        # restore, so a checkpoint of another layout is refused rather than misread).
        "quantization": quantization.storage_record(model),
    }
    if model.tokenizer is not None:
        (directory / _TOKENIZER_FILE).write_text(model.tokenizer.to_str(), encoding="utf-8")
        meta["tokenizer"] = {
            "bos_token_id": model.tokenizer.bos_token_id,
            "eos_token_ids": list(model.tokenizer.eos_token_ids),
        }
    (directory / _META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")


def read_metadata(directory: str | os.PathLike) -> tuple[dict, ModelConfig, jnp.dtype]:
    """The metadata `save_converted` wrote: (the whole record, the config, the dtype).

    Raises:
      FileNotFoundError: `directory` is not a converted model.
      ValueError: its metadata is unreadable.
    """
    directory = Path(directory).absolute()
    meta_path = directory / _META_FILE
    if not meta_path.is_file() or not (directory / _STATE_DIR).is_dir():
        raise FileNotFoundError(f"{directory} is not a converted model (no {_META_FILE})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        return meta, config_from_dict(meta["config"]), jnp.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{meta_path}: unreadable converted-model metadata: {e}") from e


def restore_converted(directory: str | os.PathLike, *, sharding: Any = None) -> Model:
    """Rebuild a model written by `save_converted`, bit for bit.

    Args:
      directory: the directory `save_converted` wrote.
      sharding: where to place the parameters. None: the default device. A single
        `jax.sharding.Sharding`: every parameter. Otherwise a pytree of shardings with
        the structure of `nnx.state(model, nnx.Param)` (an `nnx.State`, or its pure dict
        as `nnx.to_pure_dict` gives it).

    Raises:
      FileNotFoundError: `directory` is not a converted model.
      ValueError: its metadata is unreadable or `sharding` does not match the state.
    """
    import orbax.checkpoint as ocp  # imported when used: it takes a quarter second

    directory = Path(directory).absolute()
    meta, config, dtype = read_metadata(directory)
    model = abstract_model(config, dtype)
    quantized = meta.get("quantization")
    if quantized is not None:
        # Restored as saved: the QArrays' values and scales, nothing quantized again.
        spec = quantization.spec_from_record(quantized, str(directory / _META_FILE))
        quantization.abstract_quantized(model, spec)
    state = nnx.state(model, nnx.Param)
    like = nnx.to_pure_dict(state)  # ShapeDtypeStruct leaves (inside QArrays if quantized)
    target = quantization.to_storable(like)
    # Explicit restore arguments: Orbax's own inference of each leaf's sharding from the
    # checkpoint metadata took a third of the restore (scripts/bench_loading.py).
    if sharding is None:
        # Onto the default device: every array into host memory, then one batched transfer.
        restore_args = jax.tree.map(
            lambda x: ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype), target
        )
        place = jax.device_put
    else:
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(
                sharding=x.sharding, global_shape=x.shape, dtype=x.dtype
            ),
            _with_shardings(target, sharding),
        )
        place = lambda tree: tree  # noqa: E731 (read straight into the shardings)
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        directory / _STATE_DIR,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
    )
    nnx.replace_by_pure_dict(state, quantization.from_storable(place(restored), like))
    nnx.update(model, state)
    if quantized is not None:
        quantization.measure(model)  # its bytes, now that the arrays are there

    if meta.get("tokenizer") is not None:
        tok = tokenizers.Tokenizer.from_file(str(directory / _TOKENIZER_FILE))
        model.tokenizer = Tokenizer(
            tok,
            bos_token_id=meta["tokenizer"]["bos_token_id"],
            eos_token_ids=meta["tokenizer"]["eos_token_ids"],
        )
    return model


def _with_shardings(target: dict, sharding: Any) -> dict:
    """Attach `sharding` (one Sharding, or a matching pytree) to the abstract leaves."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), target
        )
    if isinstance(sharding, nnx.State):
        sharding = nnx.to_pure_dict(sharding)
    # A quantized weight's shardings come as a `QArray` of its values' and scales'
    # (`partitioning.param_shardings`): stored as the same {"qvalue", "scale"} dict.
    sharding = quantization.to_storable(sharding)
    try:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, sharding
        )
    except ValueError as e:
        raise ValueError(
            f"sharding must be one jax.sharding.Sharding or a pytree matching the model's "
            f"parameter state: {e}"
        ) from e


def restore_sharded(directory: str | os.PathLike, mesh: jax.sharding.Mesh) -> Model:
    """Restore a converted model (`save_converted`) with every parameter read straight
    into its shards on `mesh` (by the partition rules, `partitioning.param_shardings`); no
    device ever holds a full copy of a sharded weight. A quantized model's scales go
    with their weights (split along the same axis where their size allows)."""
    meta, config, dtype = read_metadata(directory)
    model = abstract_model(config, dtype)
    if meta.get("quantization") is not None:
        source = str(Path(directory).absolute() / _META_FILE)
        spec = quantization.spec_from_record(meta["quantization"], source)
        quantization.abstract_quantized(model, spec)
    return restore_converted(directory, sharding=param_shardings(model, mesh))
