"""Weight-only quantization through Qwix (the optional extra `quant`).

A quantized model is a weight format, not a model family: its linear weights are Qwix
`QArray`s (integer values and float scales) in the same `nnx.Param`s, and every product
of a weight goes through `fixed_order.product`, which hands a `QArray` to Qwix's
`dot_general` (the one matmul path for float and quantized weights).

Formats (`quantize=`):
- "int8": per output channel (one scale per output column).
- "fp8": float8 e4m3 values, per output channel like int8 (Qwix's product upcasts them;
  it runs on XLA:CPU, tested against NumPy).
- "int4": per group of `group_size` entries of the contraction, per output column; by
  default (`group_size=None`) the largest of `GROUP_SIZES` (128, 64, 32) that divides
  every quantized weight's contraction (`plan`); a contraction not divisible by a given
  `group_size` is refused, naming the weight.

What is quantized: the attention and MLP projections of every layer and a
mixture-of-experts layer's stacked expert weights (`[X, K, N]`: scales per expert and
output column, int4 groups along K; their products go through `einsum` below, Qwix's
quantized einsum). The router, the norms and biases stay in the float dtype; so do the
token embedding and the LM head unless `quantize_embedding=True` (what vLLM and torchao
leave out by default too: the head is the most sensitive product, and a gather reads
only B rows of the embedding per step).

`quantize_embedding=True` quantizes the vocabulary tables `[V, E]` (the embedding, and an
untied LM head) with a scale per vocabulary row (int4: per row and `group_size` entries
of E). A tied table is one `QArray` serving both uses: the lookup gathers the rows' values
and scales and dequantizes just those rows (`lookup`), and the head's product contracts E
through Qwix's `dot_general` (`head_product`), where a row's scale is its output
column's scale.

`load_pretrained(quantize=...)` checks the whole `plan` on the abstract model, then
quantizes each weight as it is read (`quantize_param`); `orbax_io` saves a quantized
model as `to_storable` values and scales with a `STORAGE_VERSION` tag and restores it
without quantizing again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMATS = ("int8", "int4", "fp8")
# The layout of a saved quantized model (`orbax_io`): bumped whenever what a saved
# `QArray` means changes (its fields, scale layout, or which weights are quantized).
STORAGE_VERSION = 3  # 2: MoE expert weights quantized too; 3: vocabulary tables optionally
# The versions this logitloop restores: a version-2 checkpoint is a version-3 one with
# float vocabulary tables (its record has no "embedding" entry).
READABLE_STORAGE_VERSIONS = (2, 3)
# int4's group sizes when none is given: the largest that divides every contraction.
GROUP_SIZES = (128, 64, 32)

# Parameter name -> the number of leading axes that the weight's product contracts
# (a head-split output projection `[H, D, E]` contracts H and D; the rest contract axis 0).
_PROJECTIONS = {
    "wq": 1, "wk": 1, "wv": 1, "wo": None, "w_gate": 1, "w_up": 1, "w_down": 1,
    "w_qkv": 1, "w_fc": 1, "w_proj": 1,
}  # fmt: skip
# Of those, the names a mixture-of-experts layer stacks per expert (`[X, K, N]`).
_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
# The vocabulary tables `[V, E]` `quantize_embedding=True` quantizes: the token embedding
# (tied: also the LM head) of the Llama-derived families, an untied LM head, GPT-2's.
_VOCAB_TABLES = ("embedding", "lm_head", "wte")


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
    group_size: int | None  # int4's group; None: chosen from GROUP_SIZES by `plan`
    embedding: bool = False  # the vocabulary tables (embedding, LM head) quantized too
    chosen: bool = False  # `group_size` was chosen by `plan` (none was given)

    @property
    def qtype(self):
        return {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}[self.format]


def check_quantize(
    quantize: Any, group_size: Any = None, quantize_embedding: Any = False
) -> QuantizeSpec | None:
    """`quantize`, `group_size` and `quantize_embedding` checked: None (float weights) or
    a `QuantizeSpec` (`group_size` None: int4's group is chosen by `plan`)."""
    if not isinstance(quantize_embedding, bool):
        raise ValueError(f"quantize_embedding must be True or False, got {quantize_embedding!r}")
    if quantize is None:
        if quantize_embedding:
            raise ValueError(
                "quantize_embedding=True needs a format: quantize='int8', 'int4' or 'fp8'"
            )
    elif not isinstance(quantize, str) or quantize not in FORMATS:
        raise ValueError(f"quantize must be None, 'int8', 'int4' or 'fp8', got {quantize!r}")
    if group_size is not None and (
        isinstance(group_size, bool)
        or not isinstance(group_size, (int, np.integer))
        or group_size < 1
    ):
        raise ValueError(
            "group_size must be None (int4: the largest of "
            f"{', '.join(map(str, GROUP_SIZES))} that divides every contraction) or a "
            f"positive int, got {group_size!r}"
        )
    if group_size is not None and quantize != "int4":
        raise ValueError(
            f"group_size={group_size} is int4's group along each contraction, but quantize is "
            f"{quantize!r}: pass quantize='int4' (int8 and fp8 keep one scale per output "
            "channel), or leave group_size out"
        )
    if quantize is None:
        return None
    return QuantizeSpec(
        quantize, None if group_size is None else int(group_size), quantize_embedding
    )


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


def quantize_vocab_rows(name: str, table: jax.Array, spec: QuantizeSpec):
    """A vocabulary table `[V, E]` as a `QArray`: a scale per row (the head's output
    column), and for int4 per `group_size` entries of E (the head's contraction)."""
    tiled = {}
    if spec.format == "int4":
        if table.shape[1] % spec.group_size:
            raise ValueError(
                f"quantize='int4': {name} has shape {tuple(table.shape)}; its embedding axis "
                f"1 ({table.shape[1]}) is not divisible by group_size={spec.group_size}"
            )
        tiled = {1: spec.group_size}
    return _qwix().quantize(table, spec.qtype, channelwise_axes=(0,), tiled_axes=tiled)


# `plan`'s value for a mixture's stacked expert weights `[X, K, N]` (each expert's `[K, N]`
# contracts its axis 1; no other weight contracts 0 axes).
STACKED_EXPERTS = 0
# `plan`'s value for a vocabulary table `[V, E]` (its product contracts its last axis).
VOCAB_ROWS = -1


def plan(model: nnx.Module, spec: QuantizeSpec) -> tuple[QuantizeSpec, dict[tuple, int]]:
    """The weights `spec` quantizes: `spec` with int4's group size chosen where none was
    given (the largest of `GROUP_SIZES` that divides every contraction), and parameter
    path -> axes its product contracts (`STACKED_EXPERTS` for a mixture's stacked experts).
    Checks every weight's shape first (int4's group size), so that a refused model is
    refused before any weight is read or quantized; works on an abstract model."""
    weights: dict[tuple, int] = {}
    contractions: dict[tuple, tuple] = {}  # path -> (shape, the axis int4 groups split)
    tables = _VOCAB_TABLES if spec.embedding else ()
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or not path:
            continue
        if path[-1] not in _PROJECTIONS and path[-1] not in tables:
            continue
        abstract = param.get_value()  # a ShapeDtypeStruct on an abstract model
        shape = tuple(abstract.shape)
        if path[-1] in tables:  # `[V, E]`, contracting E in the head
            contracted, axis = VOCAB_ROWS, 1
        elif path[-1] in _EXPERT_WEIGHTS and len(shape) == 3:  # moe.py's `[X, K, N]`
            contracted, axis = STACKED_EXPERTS, 1
        else:
            contracted = _PROJECTIONS[path[-1]] or (2 if len(shape) == 3 else 1)
            axis = contracted - 1
            if contracted == 2:  # stored as its 2-D view `[H * D, E]`, see `quantize_param`
                shape, axis = (shape[0] * shape[1], shape[2]), 0
        weights[tuple(path)] = contracted
        contractions[tuple(path)] = (shape, axis)
    if not weights:
        raise ValueError(f"quantize={spec.format!r}: this model has no projection weights")
    if spec.format == "int4":
        spec = _group_size(spec, contractions)
    return spec, weights


def _group_size(spec: QuantizeSpec, contractions: dict[tuple, tuple]) -> QuantizeSpec:
    """int4's `spec` with its group size checked against every weight's contraction
    (`plan`'s `contractions`), or chosen: the largest of `GROUP_SIZES` that divides all."""
    sizes = {path: shape[axis] for path, (shape, axis) in contractions.items()}
    if spec.group_size is None:
        for group in GROUP_SIZES:
            if all(n % group == 0 for n in sizes.values()):
                return dataclasses.replace(spec, group_size=group, chosen=True)
        path = next(p for p, n in sizes.items() if n % GROUP_SIZES[-1])
        shape, axis = contractions[path]
        raise ValueError(
            f"quantize='int4': no group size of {', '.join(map(str, GROUP_SIZES))} divides "
            f"every contraction: {_name(path)} has shape {shape}, its contraction axis "
            f"{axis} ({sizes[path]}); pass a group_size that divides it"
        )
    for path, n in sizes.items():
        if n % spec.group_size:
            shape, axis = contractions[path]
            raise ValueError(
                f"quantize='int4': {_name(path)} has shape {shape}; its contraction axis "
                f"{axis} ({n}) is not divisible by group_size={spec.group_size}"
            )
    return spec


def _name(path) -> str:
    return ".".join(str(p) for p in path)


def quantize_param(path: tuple, value: jax.Array, contracted: int, spec: QuantizeSpec):
    """The `QArray` of one weight (`plan` gives `contracted`)."""
    if contracted == VOCAB_ROWS:
        return quantize_vocab_rows(_name(path), value, spec)
    if contracted == STACKED_EXPERTS:
        # a mixture's stacked experts `[X, K, N]` (moe.py), each expert its own weight
        return quantize_weight(_name(path), value, 1, spec, stacked=True)
    if contracted == 2:
        # A head-split output projection `[H, D, E]` is kept as its product's 2-D view
        # `[H * D, E]` (what `layers.merge_heads` reshapes it to): Qwix cannot merge
        # the head axis into int4 groups of the head dimension afterwards.
        value = value.reshape(value.shape[0] * value.shape[1], value.shape[2])
        contracted = 1
    return quantize_weight(_name(path), value, contracted, spec)


def quantize_model(model: nnx.Module, spec: QuantizeSpec) -> None:
    """Replace a float model's projection (and stacked expert) weights with their
    `QArray`s, one tensor at a time, and record what was quantized (`record`).
    `load_pretrained(quantize=...)` instead quantizes each tensor as it is read
    (`loading._fill_parameters`)."""
    spec, weights = plan(model, spec)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and tuple(path) in weights:
            param.set_value(quantize_param(tuple(path), param[...], weights[tuple(path)], spec))
    record(model, spec, weights)


def record(model: nnx.Module, spec: QuantizeSpec, weights: dict[tuple, int]) -> None:
    """Set `model.quantization` (what `describe` and the repr report) from `plan`'s
    `weights`."""
    experts = sum(c == STACKED_EXPERTS for c in weights.values())
    tables = sum(c == VOCAB_ROWS for c in weights.values())
    model.quantization = Quantization(spec, len(weights) - experts - tables, experts, tables)
    measure(model)


def measure(model: nnx.Module) -> None:
    """Record the parameters' bytes in `model.quantization` (what `describe` reports): as
    the format counts them (`parameter_bytes`) and in the backend's buffers
    (`device_bytes`); nothing on an abstract model (`orbax_io` measures after restoring)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    if not all(isinstance(leaf, jax.Array) for leaf in leaves):
        return
    model.quantization = dataclasses.replace(
        model.quantization, format_bytes=parameter_bytes(model), device_bytes=device_bytes(model)
    )


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What `quantize_model` did (the model's `quantization` attribute)."""

    spec: QuantizeSpec
    weights: int  # projection weights quantized
    expert_weights: int = 0  # stacked expert weights `[X, K, N]` quantized
    vocab_tables: int = 0  # vocabulary tables `[V, E]` quantized (1 tied, 2 untied)
    # All parameters' bytes (`measure`): as the format counts them, and in the backend's
    # buffers (all devices). Not compared: the same quantization on a mesh holds more.
    format_bytes: int | None = dataclasses.field(default=None, compare=False)
    device_bytes: int | None = dataclasses.field(default=None, compare=False)

    def __repr__(self) -> str:  # the model's repr says what is quantized and what is float
        return f"Quantization({self.describe()!r})"

    def describe(self) -> str:
        s = self.spec
        how = f"groups of {s.group_size}" if s.format == "int4" else "per output channel"
        if s.chosen:
            largest = ", ".join(map(str, GROUP_SIZES))
            how += f", the largest of {largest} dividing every contraction"
        if self.vocab_tables:
            tied = self.vocab_tables == 1
            tables = "tied embedding and LM head" if tied else "embedding and LM head"
            text = (
                f"{s.format} weights ({how}) for {self.weights} attention/MLP projections; "
                f"{tables} {s.format} per vocabulary row; norms and biases in float"
            )
        else:
            text = (
                f"{s.format} weights ({how}) for {self.weights} attention/MLP projections; "
                "embedding, LM head, norms and biases in float"
            )
        if self.expert_weights:
            text = text.replace(
                "projections;", f"projections and {self.expert_weights} stacked expert weights;"
            )
        if self.format_bytes is not None:
            half = " (int4 at half a byte)" if s.format == "int4" else ""
            text += (
                f"; parameters {self.format_bytes / 2**20:.2f} MiB in the format{half}, "
                f"{self.device_bytes / 2**20:.2f} MiB in the backend's buffers"
            )
        return text


def at_use(x: jax.Array, w: Any) -> Any:
    """The `QArray` `w` with its integer values made to depend on the activation `x` (a
    select on a predicate of `x`'s first element's bits that is always true, `(bits | 1)
    != 0`, which XLA cannot prove), so that the dequantized weight is computed at the
    product, inside the step that uses it.

    Without it a weight's dequantization is loop-invariant in the decode `while_loop` and
    XLA hoists it out of the loop: a float copy of every quantized weight held for the
    whole loop, more memory than the float model (a Llama 3.2 1B shape in float32: 6.68 GB
    peak during `generate` against the float model's 5.73 GB). With it the float weight is
    a temporary of one product at a time, and the select is one more operation in the
    dequantizing fusion (`scripts/bench_quant_memory.py`, BENCHMARKS.md). An
    `optimization_barrier` does not do this on XLA:CPU: it is removed before the loop
    optimizations run."""
    if x.size == 0:
        return w
    first = jax.lax.slice(x.reshape(-1), (0,), (1,))  # [1]
    bits = jax.lax.bitcast_convert_type(first, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    keep = (bits[0] | 1) != 0  # always true
    qvalue = jnp.where(keep, w.qvalue, jnp.zeros((), w.qvalue.dtype))
    return dataclasses.replace(w, qvalue=qvalue)


def product(rows: jax.Array, w: Any) -> jax.Array:
    """`rows @ w` for a `QArray` `w` `[K, N]`, in `rows`' dtype (Qwix's quantized
    `dot_general`: integer weights, scales applied to the output or per group; the weight
    dequantized at the product, `at_use`)."""
    w = at_use(rows, w)
    out = _qwix().dot_general(rows, w, (((1,), (0,)), ((), ())))
    return out.astype(rows.dtype)


def head_product(rows: jax.Array, table: Any) -> jax.Array:
    """The LM head `rows @ table.T`, `[M, E] x [V, E]^T -> [M, V]` float32, for a quantized
    vocabulary table (Qwix's `dot_general`: each row's scale is an output column's)."""
    table = at_use(rows, table)
    dims = (((1,), (1,)), ((), ()))
    return _qwix().dot_general(rows, table, dims, preferred_element_type=jnp.float32)


def dequantize(w: Any, rows: jax.Array | None = None) -> jax.Array:
    """The `QArray` `w`'s float value (Qwix's dequantize: values times scales in the
    scales' dtype, what its product computes before a float product); inside a program,
    computed at `rows`' product (`at_use`)."""
    return _qwix().dequantize(w if rows is None else at_use(rows, w))


def lookup(table: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
    """The embedding rows of `tokens`, `[..., E]` in `dtype`; a token outside the table
    reads its nearest row (clipped: a pad id past the vocabulary cannot produce NaN). A
    quantized table gathers only those rows' values and scales and dequantizes them as
    Qwix's product does (values times scale in the scale's dtype)."""
    if not is_quantized(table):
        return jnp.take(table, tokens, axis=0, mode="clip").astype(dtype)
    values = jnp.take(table.qvalue, tokens, axis=0, mode="clip")  # [..., E]
    scales = jnp.take(table.scale, tokens, axis=0, mode="clip")  # [..., G]: E in G groups
    e, g = values.shape[-1], scales.shape[-1]
    grouped = values.astype(scales.dtype).reshape(*values.shape[:-1], g, e // g)
    return (grouped * scales[..., None]).reshape(values.shape).astype(dtype)


def einsum(subscripts: str, x: jax.Array, w: Any) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` in `x`'s dtype, through Qwix's quantized einsum when
    `w` is a `QArray` (the expert products of moe.py: one path for float and quantized)."""
    if not is_quantized(w):
        return jnp.einsum(subscripts, x, w)
    w = at_use(x, w)
    return _qwix().einsum(subscripts, x, w).astype(x.dtype)


def parameter_bytes(model: nnx.Module) -> int:
    """The bytes of the model's parameters as the format counts them (a `QArray`'s values
    and scales; int4 counted at half a byte). What the backend holds can be more:
    `device_bytes`."""
    total = 0
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        bits = 4 if leaf.dtype in (jnp.int4, jnp.uint4) else leaf.dtype.itemsize * 8
        total += math.prod(leaf.shape) * bits // 8
    return total


def device_bytes(model: nnx.Module) -> int:
    """The bytes the backend holds for the model's parameters: every array's device
    buffers (`on_device_size_in_bytes()`, all its shards). XLA:CPU keeps each int4 value in
    a whole byte, so there an int4 weight holds what an int8 one does."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(leaf.on_device_size_in_bytes() for leaf in leaves)


def storage_record(model: nnx.Module) -> dict | None:
    """What a saved checkpoint records about `model`'s quantization (None: float)."""
    q = getattr(model, "quantization", None)
    if q is None:
        return None
    return {
        "storage_version": STORAGE_VERSION,
        "format": q.spec.format,
        "group_size": q.spec.group_size,
        "embedding": q.spec.embedding,
    }


def spec_from_record(record_: dict, source: str) -> QuantizeSpec:
    """The `QuantizeSpec` of a saved quantized model, refusing another storage version."""
    version = record_.get("storage_version")
    if version not in READABLE_STORAGE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_STORAGE_VERSIONS)
        raise ValueError(
            f"{source}: quantized with logitloop quantization storage version {version!r}; "
            f"this logitloop reads versions {readable} (re-quantize from the "
            "float checkpoint: load_pretrained(path, quantize=...))"
        )
    embedding = record_.get("embedding", False)  # version 2: float vocabulary tables
    fmt = record_.get("format")
    # Checkpoints saved before 2026-12 record the group size int8 and fp8 never used.
    group_size = record_.get("group_size") if fmt == "int4" else None
    return check_quantize(fmt, group_size, embedding)


def to_storable(tree: Any) -> Any:
    """A pure-dict state with each `QArray` as a plain dict `{"qvalue", "scale"}` (what
    Orbax writes; the quantization type is recorded in the metadata)."""
    if is_quantized(tree):
        if tree.zero_point is not None:  # weight-only formats here are symmetric
            raise ValueError("cannot save an asymmetric (zero-point) QArray")
        return {"qvalue": tree.qvalue, "scale": tree.scale}
    if isinstance(tree, dict):
        return {k: to_storable(v) for k, v in tree.items()}
    return tree


def from_storable(tree: Any, like: Any) -> Any:
    """Inverse of `to_storable`, with `like` (a pure-dict state) saying where `QArray`s go."""
    if is_quantized(like):
        return dataclasses.replace(like, qvalue=tree["qvalue"], scale=tree["scale"])
    if isinstance(like, dict):
        return {k: from_storable(tree[k], v) for k, v in like.items()}
    return tree


def abstract_quantized(model: nnx.Module, spec: QuantizeSpec) -> None:
    """Give an abstract model the abstract `QArray`s `spec` makes (shapes only, nothing
    computed): the target a saved quantized model is restored into."""
    spec, weights = plan(model, spec)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and tuple(path) in weights:
            how = weights[tuple(path)]
            param.set_value(
                jax.eval_shape(
                    lambda w, path=tuple(path), how=how: quantize_param(path, w, how, spec),
                    param.get_value(),
                )
            )
    record(model, spec, weights)
