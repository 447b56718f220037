"""Model weights over a device mesh: the partition rules (the sharded Orbax restore that
reads by them is `orbax_io.restore_sharded`).

Weights go over the mesh's "model" axis by their logical axis names (`nnx.get_partition_spec`
reads them from the parameters' metadata, set by `layers.param`): "experts", "heads",
"kv_heads", "mlp" and "vocab" map to "model", at most once per parameter (the first such
dimension that the model-axis size divides: a mixture's stacked experts go over the model
axis whole, expert parallelism, when their number allows, else their "mlp" axis);
everything else ("embed", "head_dim", unnamed axes) is replicated. A dimension that the
model-axis size does not divide is replicated instead (`mesh_spec`), as is every weight
of a pytree that carries no names. The decode loop's
layout of rows and caches lives with the loop (`logitloop.decoding.loop.sharding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from logitloop.models import quantization
from logitloop.ops.sampling.sharded import auto_axes

MODEL_AXIS = "model"
DATA_AXIS = "data"  # the rows (`logitloop.decoding.loop.sharding`, `fixed_order.rowwise`)
# Logical parameter axes laid over the model axis; the rest are replicated.
MODEL_PARALLEL_AXES = frozenset({"experts", "heads", "kv_heads", "mlp", "vocab"})


def _model_mesh(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh)!r}")
    if MODEL_AXIS not in mesh.shape:
        raise ValueError(
            f"mesh has axes {tuple(mesh.axis_names)}; the weights need a {MODEL_AXIS!r} axis "
            "(give it size 1 to replicate them)"
        )
    return auto_axes(mesh)


def mesh_spec(names: Any, shape: tuple[int, ...], model_size: int) -> P:
    """Logical axis names of one parameter -> its PartitionSpec over the mesh.

    A name in `MODEL_PARALLEL_AXES` whose dimension `model_size` divides becomes "model"
    (at most once per parameter); every other dimension is replicated.
    """
    names = tuple(names) if isinstance(names, (tuple, list, P)) else ()
    out: list[str | None] = []
    used = False
    for i, dim in enumerate(shape):
        name = names[i] if i < len(names) else None
        if (
            not used
            and model_size > 1
            and isinstance(name, str)
            and name in MODEL_PARALLEL_AXES
            and dim % model_size == 0
        ):
            out.append(MODEL_AXIS)
            used = True
        else:
            out.append(None)
    return P(*out)


def partition_specs(weights: Any, model_size: int) -> Any:
    """PartitionSpecs for a model's parameters (same tree structure as `weights`).

    weights: an NNX module (its `nnx.Param` state), an `nnx.State` (as `nnx.split` or
    `nnx.state` give it; arrays or `ShapeDtypeStruct`s), or any other pytree of arrays,
    which is replicated.
    """
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights, nnx.Param)
    if isinstance(weights, nnx.State):
        logical = nnx.get_partition_spec(weights)
    else:
        logical = jax.tree.map(lambda _: P(), weights)
    return jax.tree.map(
        lambda w, names: _weight_spec(w, names if isinstance(names, P) else (), model_size),
        weights,
        logical,
        is_leaf=quantization.is_quantized,
    )


def _weight_spec(w: Any, names: tuple, model_size: int) -> Any:
    """One weight's PartitionSpec; for a quantized weight (a Qwix `QArray`) a `QArray` of
    the specs of its values and scales, so that the scales go with their weight."""
    if not quantization.is_quantized(w):
        return mesh_spec(names, w.shape, model_size)
    names = tuple(names)
    if len(names) == w.ndim + 1:
        # A head-split output projection `[H, D, E]` is stored as `[H * D, E]`
        # (`quantization.quantize_param`): the merged axis takes the heads' name, so a
        # model axis that divides H gives each device whole heads, as the float weight.
        names = (names[0], *names[2:])
    value_spec = mesh_spec(names, w.shape, model_size)
    # The scales take the values' axis where their own size there splits into whole
    # shards over it (a per-column scale's size-1 contraction axis, or an int4 scale
    # whose groups the model axis does not divide, stays replicated): each device then
    # holds the scales of exactly its own values.
    scale_spec = P(
        *(
            axis if axis is not None and n % model_size == 0 and n > 1 else None
            for axis, n in zip(tuple(value_spec), w.scale.shape, strict=True)
        )
    )
    return dataclasses.replace(w, qvalue=value_spec, scale=scale_spec)


def param_shardings(weights: Any, mesh: Mesh) -> Any:
    """`NamedSharding`s for a model's parameters by the logical-axis rules.

    Passing a module gives the tree `restore_converted(..., sharding=...)` expects.
    """
    mesh = _model_mesh(mesh)
    specs = partition_specs(weights, mesh.shape[MODEL_AXIS])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def put(x: Any, sharding: NamedSharding) -> Any:
    """`x` on `sharding`: as it is where it is already there, else `jax.device_put`."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def place_weights(weights: Any, mesh: Mesh) -> Any:
    """Lay `weights` (an `nnx.State` or any pytree) over the mesh by the rules."""
    return jax.tree.map(put, weights, param_shardings(weights, mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an NNX model's parameters onto the mesh in place (once, before generating)."""
    state = nnx.state(model)
    nnx.update(model, place_weights(state, mesh))
    return model
