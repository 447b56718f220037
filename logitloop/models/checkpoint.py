"""What a Hugging Face checkpoint is made of, as every family reads it: its parsed
`config.json` (`HFConfig`) and where each of its tensors goes in a model
(`CheckpointTensor`).

The registry (`registry.ModelFamily` names both in its signatures), the configs and the
layers import these from here; this module imports nothing from `logitloop.models`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _check_activation(act: str, source: str) -> None:
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"{source}: unsupported activation {act!r}; "
            f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A parsed `config.json`, as each family's `parse_config` receives it.

    Attributes:
      fields: the parsed JSON object.
      source: the file name used in error messages.
      eos_token_id: every end-of-sequence id (`generation_config.json` first); possibly empty.
      bos_token_id: the beginning-of-sequence id, or None.
    """

    fields: Mapping[str, Any]
    source: str = "config.json"
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def model_type(self) -> str:
        return self.fields["model_type"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def need(self, key: str) -> Any:
        """The field `key`; a ValueError naming the file and the field when it is absent."""
        if key not in self.fields or self.fields[key] is None:
            raise ValueError(
                f"{self.source}: model_type {self.model_type!r} requires field {key!r}"
            )
        return self.fields[key]

    def activation(self, key: str, default: str) -> str:
        """The activation named by field `key`, checked against `SUPPORTED_ACTIVATIONS`."""
        act = self.fields.get(key, default)
        _check_activation(act, self.source)
        return act


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor of a Hugging Face checkpoint goes in a model.

    Attributes:
      target: attribute/index path of the `nnx.Param` it fills, e.g. ("layers", 0, "wq").
      shape: the tensor's shape in the checkpoint, checked before it is read.
      transform: maps the checkpoint layout onto the parameter layout (transposes and
        reshapes); identity when they agree.
      more_targets: for a tensor that fills several parameters, the ones after `target`.
      stack_index: for one of several tensors stacked into one parameter (the experts of
        a mixture, stored one tensor per expert), its index along the parameter's axis 0.
    """

    target: tuple[str | int, ...]
    shape: tuple[int, ...]
    transform: Callable[[jax.Array], jax.Array] = lambda x: x
    more_targets: tuple[tuple[str | int, ...], ...] = ()
    stack_index: int | None = None

    def placements(self, value) -> list[tuple[tuple[str | int, ...], jax.Array]]:
        """(target, array) pairs for the transformed `value`. A fused tensor (Phi-3's qkv)
        names its further parameters in `more_targets`; its `transform` then returns one
        array per target, `target` first."""
        if not self.more_targets:
            return [(self.target, value)]
        return list(zip((self.target, *self.more_targets), value, strict=True))
