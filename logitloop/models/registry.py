"""Which model serves which Hugging Face `model_type`: one registry entry per type.

An entry (`ModelFamily`) names everything the library needs to read a checkpoint of that
type: how `config.json` becomes a config, the module built from that config, and where
each checkpoint tensor goes in it. `config_from_hf`, `load_pretrained`, the Orbax restore
and the mesh rules look the architecture up here and nowhere else, so a new family is
one module that calls `register` (imported from `logitloop/models/__init__.py`):

    register(ModelFamily(
        model_type="gemma",
        config_class=GemmaConfig,            # frozen dataclass, fields as in config.py
        parse_config=gemma_config_from_hf,   # config.HFConfig -> GemmaConfig
        model_class=GemmaModel,              # a decoder.DecoderModel
        checkpoint_tensors=checkpoint_tensors,
    ))

This module imports nothing from the families (only `checkpoint`, what a checkpoint is
made of), so any of them may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from logitloop.models.checkpoint import CheckpointTensor, HFConfig


def _same_name(name: str) -> str:
    return name


def _nothing_ignored(name: str, config: Any) -> bool:
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """How to read and build the models of one `model_type`.

    Attributes:
      model_type: the Hugging Face `model_type` in `config.json`.
      config_class: the frozen dataclass of its configs; `config.config_from_dict`
        rebuilds one from `dataclasses.asdict` output by its field types.
      parse_config: `config.json` (as a `config.HFConfig`) -> a `config_class` instance.
      model_class: `model_class(config, *, dtype, rngs)` builds the model.
      checkpoint_tensors: config -> every tensor the checkpoint must hold, by name.
      checkpoint_name: a tensor name as stored -> as `checkpoint_tensors` spells it
        (e.g. without a `transformer.` prefix).
      is_ignored_tensor: (normalised name, config) -> True for tensors a checkpoint may
        carry that the model does not use.
    """

    model_type: str
    config_class: type
    parse_config: Callable[[HFConfig], Any]
    model_class: type
    checkpoint_tensors: Callable[[Any], dict[str, CheckpointTensor]]
    checkpoint_name: Callable[[str], str] = _same_name
    is_ignored_tensor: Callable[[str, Any], bool] = _nothing_ignored


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add `family`; its `model_type` must not be registered already."""
    if family.model_type in _FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is already registered")
    _FAMILIES[family.model_type] = family
    return family


def model_types() -> tuple[str, ...]:
    """Every registered `model_type`, in registration order."""
    return tuple(_FAMILIES)


def family_for(model_type: str) -> ModelFamily:
    """The family registered for `model_type`.

    Raises:
      ValueError: naming the supported types, when `model_type` is not registered.
    """
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(model_types())}"
        )
    return family
