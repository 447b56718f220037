"""Generation over a device mesh: rows over a "data" axis, weights over a "model" axis.

`generate(model, prompts, params, mesh=mesh)` (and `stream`) run the same prefill and decode
loop as on one device, laid out over a `jax.sharding.Mesh` with axes "data" and "model":

- Rows go over "data". The batch is padded to a multiple of the data-axis size with dummy
  rows (copies of row 0 that stop after one token) which never reach the result.
- Weights go over "model" by their logical axis names, by the rules that live with the
  models (`logitloop.models.partitioning`, re-exported here): "heads", "kv_heads", "mlp"
  and "vocab" map to "model", the rest is replicated, as is every weight of a
  `FunctionModel`, which carries no names. Weights already laid out by the rules (a
  `restore_sharded` model, or `shard_model`) are not moved; others are `device_put`.
- The KV cache (`[B, H, S, D]` per layer and per k/v) has its rows over "data" and its
  heads over "model" when the head count is divisible, like the k/v projections.
- Inside the jit-compiled prefill and decode, `with_sharding_constraint` pins the inputs
  and the loop state to these layouts and GSPMD propagates them through the model. The
  logits come out of the LM head vocabulary-sharded; the sampling step then runs in one
  `shard_map` (`sample_sharded`) that never gathers the vocabulary onto one device.

Tokens equal the single-device run's: the sampler's decisions are exact under sharding
(`logitloop.ops.sampling.sharded`), and the model's logits differ from one device's at
most by float rounding of sharded matrix products, which changes a token only at an exact
near-tie (a greedy gap or a top-p boundary within a few ulps).

Several hosts: call `jax.distributed.initialize(...)` first in every process, build the
mesh over `jax.devices()` (all processes' devices), and call `generate` in every process
with the same arguments; each process gets the whole result (see `docs/sharding.md`).

Converted (Orbax) checkpoints restore straight onto the mesh: `restore_sharded(dir, mesh)`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from logitloop.decoding import sampler
from logitloop.decoding.history import History
from logitloop.decoding.params import SamplingParams
from logitloop.models.partitioning import (  # noqa: F401 - re-exported: the mesh API in one place
    MODEL_AXIS,
    param_shardings,
    place_weights,
    restore_sharded,
    shard_model,
)
from logitloop.ops.sampling.sharded import auto_axes
from logitloop.ops.sampling.xla import Axes

DATA_AXIS = "data"


# ----------------------------------------------------------------------------- the mesh


def as_auto(mesh: Mesh | None) -> Mesh | None:
    """Check `mesh` and return it with every axis in `AxisType.Auto` (GSPMD) mode.

    `jax.make_mesh` makes Explicit axes by default; the decode loop lays arrays out with
    sharding constraints and lets GSPMD propagate them, which needs Auto axes. The devices
    and axis names are kept, so shardings built on either mesh place data identically.
    """
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh)!r}")
    missing = [a for a in (DATA_AXIS, MODEL_AXIS) if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"mesh has axes {tuple(mesh.axis_names)}; it needs a {DATA_AXIS!r} axis (rows) "
            f"and a {MODEL_AXIS!r} axis (weights); give unused ones size 1"
        )
    return auto_axes(mesh)


def _named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(as_auto(mesh), spec)


# ----------------------------------------------------------------------------- rows, cache


def _row_spec(x: Any, batch: int) -> P:
    return P(DATA_AXIS) if np.ndim(x) >= 1 and np.shape(x)[0] == batch else P()


def _cache_spec(x: Any, batch: int, model_size: int) -> P:
    """[B, H, S, D] cache arrays: rows over data, heads over model when divisible."""
    shape = np.shape(x)
    spec: list[str | None] = [None] * len(shape)
    if shape and shape[0] == batch:
        spec[0] = DATA_AXIS
    if len(shape) == 4 and model_size > 1 and shape[1] % model_size == 0:
        spec[1] = MODEL_AXIS
    return P(*spec)


def row_shardings(tree: Any, batch: int, mesh: Mesh) -> Any:
    """Leaves with a leading axis of length `batch` over "data", the rest replicated."""
    return jax.tree.map(lambda x: _named(mesh, _row_spec(x, batch)), tree)


def cache_shardings(cache: Any, batch: int, mesh: Mesh) -> Any:
    size = as_auto(mesh).shape[MODEL_AXIS]
    return jax.tree.map(lambda x: _named(mesh, _cache_spec(x, batch, size)), cache)


def constrain_rows(tree: Any, mesh: Mesh | None, batch: int | None = None) -> Any:
    """Inside jit: pin a pytree of per-row arrays to rows over "data" (no-op without mesh)."""
    if mesh is None:
        return tree
    if batch is None:
        batch = np.shape(jax.tree.leaves(tree)[0])[0]
    return jax.lax.with_sharding_constraint(tree, row_shardings(tree, batch, mesh))


def constrain_cache(cache: Any, batch: int, mesh: Mesh | None) -> Any:
    """Inside jit: pin a KV cache to its mesh layout (no-op without mesh)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, batch, mesh))


def constrain_state(state: Any, mesh: Mesh | None) -> Any:
    """Inside jit: pin a `DecodeState` (rows over data, cache by `cache_shardings`)."""
    if mesh is None:
        return state
    batch = state.tokens.shape[0]
    rest = constrain_rows(state.replace(cache=None), mesh, batch)
    return rest.replace(cache=constrain_cache(state.cache, batch, mesh))


def pad_rows(params: SamplingParams, mesh: Mesh | None) -> SamplingParams:
    """Append dummy rows up to a multiple of the data-axis size.

    A dummy row copies row 0 with `max_tokens = 1`, `min_tokens = 0` and no stop strings,
    so it finishes on its first token and never holds the loop open.
    """
    if mesh is None:
        return params
    batch = params.batch_size
    pad = -batch % as_auto(mesh).shape[DATA_AXIS]
    if pad == 0:
        return params
    padded = params.take(list(range(batch)) + [0] * pad)
    dummy = np.arange(batch + pad) >= batch
    return dataclasses.replace(
        padded,
        max_tokens=jnp.where(dummy, 1, padded.max_tokens),
        min_tokens=jnp.where(dummy, 0, padded.min_tokens),
        stop=padded.stop[:batch] + ((),) * pad if padded.stop else (),
    )


def shard_inputs(info: Any, params: SamplingParams, mesh: Mesh | None):
    """Host side of `prepare`: weights onto the mesh, params padded to the data axis."""
    if mesh is None:
        return info, params
    info = dataclasses.replace(info, weights=place_weights(info.weights, mesh))
    return info, pad_rows(params, mesh)


def host_view(tree: Any, mesh: Mesh | None) -> Any:
    """Arrays the host can read in every process (`jax.device_get`), from a sharded tree.

    On one host every array already is; across hosts, arrays spanning other processes'
    devices are replicated first (every process must call this alike). A `DecodeState`'s
    cache is dropped: the host never reads it.
    """
    if mesh is None:
        return tree
    if hasattr(tree, "cache") and hasattr(tree, "replace"):
        tree = tree.replace(cache=None)
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return tree
    return jax.jit(lambda t: t, out_shardings=_named(mesh, P()))(tree)


# ----------------------------------------------------------------------------- sampling


def sample_sharded(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None = None,
    *,
    mesh: Mesh,
    axis: str | None = MODEL_AXIS,
    batch_axis: str | None = DATA_AXIS,
) -> sampler.SampleOutput:
    """`sampler.sample` on a mesh: the same step (`sampler.sample_step`) in one shard_map.

    With the vocabulary split over mesh axis `axis`, every step runs on each device's slice
    of the logits: masks, bias, bans and penalties on its own columns (token ids mapped to
    local columns), the candidates, thresholds and race with their reductions over `axis`,
    the raw log-softmax with a reduced max and sum. Only per-row results cross the mesh.
    The tokens equal `sample`'s (see `logitloop.ops.sampling.sharded` for what is exact);
    the log-probabilities agree to float32 rounding. Rows go over `batch_axis` (None:
    replicated); V must be a multiple of the size of `axis` (None: every device holds
    whole rows) and B of `batch_axis`.
    """
    mesh = auto_axes(mesh)
    batch, vocab = logits.shape
    if axis is not None and vocab % mesh.shape[axis]:
        raise ValueError(f"vocabulary {vocab} is not a multiple of mesh axis {axis!r}")
    if batch_axis is not None and batch % mesh.shape[batch_axis]:
        raise ValueError(f"batch {batch} is not a multiple of mesh axis {batch_axis!r}")
    axes = Axes(vocab=axis, rows=() if batch_axis is None else (batch_axis,), in_mesh=True)
    row = P(batch_axis)
    fn = jax.shard_map(
        functools.partial(sampler.sample_step, axes=axes),
        mesh=mesh,
        in_specs=(P(batch_axis, axis), row, row, row),
        out_specs=row,
        check_vma=False,
    )
    return fn(logits, params.device_only(), jnp.asarray(positions, jnp.int32), history)


def sample(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None,
    mesh: Mesh | None,
) -> sampler.SampleOutput:
    """The decode loop's sampling step: `sampler.sample_step` on one device, or under
    `shard_map` on a mesh, the vocabulary split over "model" when its size divides V and
    the rows over "data" when its size divides B."""
    if mesh is None:
        return sampler.sample_step(logits, params, positions, history)
    batch, vocab = logits.shape
    size = mesh.shape[MODEL_AXIS]
    vocab_axis = MODEL_AXIS if size > 1 and vocab % size == 0 else None
    rows = DATA_AXIS if batch % mesh.shape[DATA_AXIS] == 0 else None
    return sample_sharded(
        logits, params, positions, history, mesh=mesh, axis=vocab_axis, batch_axis=rows
    )
