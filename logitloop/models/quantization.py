"""Weight-only quantization through Qwix (the optional extra `quant`).

A quantized model is a weight format, not a model family: its linear weights are Qwix
`QArray`s (integer values and float scales) in the same `nnx.Param`s, and every product
of a weight goes through `fixed_order.product`, which hands a `QArray` to Qwix's
`dot_general` (the one matmul path for float and quantized weights).

Formats (`quantize=`):
- "int8": per output channel (one scale per output column).
- "int4": per group of `group_size` entries of the contraction, per output column; a
  contraction not divisible by `group_size` is refused.

What is quantized: the attention and MLP projections of every layer and a
mixture-of-experts layer's stacked expert weights (`[X, K, N]`: scales per expert and
output column, int4 groups along K; their products go through `einsum` below, Qwix's
quantized einsum). The token embedding, the LM head, the router, the norms and biases
stay in the float dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

FORMATS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128

# Parameter name -> the number of leading axes that the weight's product contracts
# (a head-split output projection `[H, D, E]` contracts H and D; the rest contract axis 0).
_PROJECTIONS = {
    "wq": 1, "wk": 1, "wv": 1, "wo": None, "w_gate": 1, "w_up": 1, "w_down": 1,
    "w_qkv": 1, "w_fc": 1, "w_proj": 1,
}  # fmt: skip
# Of those, the names a mixture-of-experts layer stacks per expert (`[X, K, N]`).
_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _qwix():
    try:
        import qwix
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("quantize= needs Qwix: pip install 'logitloop[quant]'") from e
    return qwix


@dataclasses.dataclass(frozen=True)
class QuantizeSpec:
    """A checked `quantize=` setting."""

    format: str
    group_size: int

    @property
    def qtype(self):
        return {"int8": jnp.int8, "int4": jnp.int4}[self.format]


def check_quantize(quantize: Any, group_size: Any = DEFAULT_GROUP_SIZE) -> QuantizeSpec | None:
    """`quantize` and `group_size` checked: None (float weights) or a `QuantizeSpec`."""
    if quantize is None:
        return None
    if quantize == "fp8":
        raise ValueError(
            "quantize='fp8': float8 (e4m3) weights are not supported yet; use 'int8' or 'int4'"
        )
    if not isinstance(quantize, str) or quantize not in FORMATS:
        raise ValueError(f"quantize must be None, 'int8' or 'int4', got {quantize!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return QuantizeSpec(quantize, group_size)


def is_quantized(w: Any) -> bool:
    """Whether `w` is a Qwix `QArray` (without importing Qwix when it is not installed)."""
    return type(w).__name__ == "QArray" and hasattr(w, "qvalue") and hasattr(w, "scale")


def quantize_weight(
    name: str, w: jax.Array, contracted: int, spec: QuantizeSpec, *, stacked: bool = False
):
    """One weight as a `QArray`: scales per output entry (the axes after the first
    `contracted`), and for int4 per `group_size` entries of the last contracted axis
    (the others, e.g. the heads of `[H, D, E]`, one scale each). `stacked`: `w` is
    `[X, K, N]`, X experts' `[K, N]` weights, each quantized as its own (axis 0 is not
    contracted: a scale per expert)."""
    qwix = _qwix()
    if stacked:
        output_axes = (0, *range(contracted + 1, w.ndim))
        last = contracted
    else:
        output_axes = tuple(range(contracted, w.ndim))
        last = contracted - 1
    tiled = {}
    if spec.format == "int4":
        if w.shape[last] % spec.group_size:
            raise ValueError(
                f"quantize='int4': {name} has shape {tuple(w.shape)}; its contraction axis "
                f"{last} ({w.shape[last]}) is not divisible by group_size={spec.group_size}"
            )
        tiled = {axis: 1 for axis in range(last) if axis not in output_axes}
        tiled[last] = spec.group_size
    return qwix.quantize(w, spec.qtype, channelwise_axes=output_axes, tiled_axes=tiled)


def quantize_model(model: nnx.Module, spec: QuantizeSpec) -> None:
    """Replace the model's projection weights with their `QArray`s, one tensor at a time,
    and record what was quantized in `model.quantization`."""
    names: list[str] = []
    experts = 0
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or not path or path[-1] not in _PROJECTIONS:
            continue
        value = param[...]
        name = ".".join(str(p) for p in path)
        if path[-1] in _EXPERT_WEIGHTS and value.ndim == 3:
            # a mixture's stacked experts `[X, K, N]` (moe.py), each expert its own weight
            param.set_value(quantize_weight(name, value, 1, spec, stacked=True))
            del value
            experts += 1
            continue
        contracted = _PROJECTIONS[path[-1]] or (2 if value.ndim == 3 else 1)
        if contracted == 2:
            # A head-split output projection `[H, D, E]` is kept as its product's 2-D view
            # `[H * D, E]` (what `layers.merge_heads` reshapes it to): Qwix cannot merge
            # the head axis into int4 groups of the head dimension afterwards.
            value = value.reshape(value.shape[0] * value.shape[1], value.shape[2])
            contracted = 1
        param.set_value(quantize_weight(name, value, contracted, spec))
        del value
        names.append(name)
    if not names:
        raise ValueError(f"quantize={spec.format!r}: this model has no projection weights")
    model.quantization = Quantization(spec, len(names), experts)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What `quantize_model` did (the model's `quantization` attribute)."""

    spec: QuantizeSpec
    weights: int  # projection weights quantized
    expert_weights: int = 0  # stacked expert weights `[X, K, N]` quantized

    def describe(self) -> str:
        s = self.spec
        how = "per output channel" if s.format == "int8" else f"groups of {s.group_size}"
        text = (
            f"{s.format} weights ({how}) for {self.weights} attention/MLP projections; "
            "embedding, LM head, norms and biases in float"
        )
        if self.expert_weights:
            text = text.replace(
                "projections;", f"projections and {self.expert_weights} stacked expert weights;"
            )
        return text


def product(rows: jax.Array, w: Any) -> jax.Array:
    """`rows @ w` for a `QArray` `w` `[K, N]`, in `rows`' dtype (Qwix's quantized
    `dot_general`: integer weights, scales applied to the output or per group)."""
    out = _qwix().dot_general(rows, w, (((1,), (0,)), ((), ())))
    return out.astype(rows.dtype)


def einsum(subscripts: str, x: jax.Array, w: Any) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` in `x`'s dtype, through Qwix's quantized einsum when
    `w` is a `QArray` (the expert products of moe.py: one path for float and quantized)."""
    if not is_quantized(w):
        return jnp.einsum(subscripts, x, w)
    return _qwix().einsum(subscripts, x, w).astype(x.dtype)


def parameter_bytes(model: nnx.Module) -> int:
    """The bytes of the model's parameters as stored (a `QArray`'s values and scales; int4
    counted at half a byte)."""
    total = 0
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        bits = 4 if leaf.dtype in (jnp.int4, jnp.uint4) else leaf.dtype.itemsize * 8
        total += math.prod(leaf.shape) * bits // 8
    return total
