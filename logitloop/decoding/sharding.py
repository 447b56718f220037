"""Generation over a device mesh: rows over a "data" axis, weights over a "model" axis.

`generate(model, prompts, params, mesh=mesh)` (and `stream`) run the same prefill and decode
loop as on one device, laid out over a `jax.sharding.Mesh` with axes "data" and "model":

- Rows go over "data". The batch is padded to a multiple of the data-axis size with dummy
  rows (copies of row 0 that stop after one token) which never reach the result.
- Weights go over "model" by their logical axis names (`nnx.get_partition_spec` reads them
  from the parameters' metadata): "heads", "kv_heads", "mlp" and "vocab" map to "model",
  everything else ("embed", "head_dim", unnamed axes) is replicated. A dimension that the
  model-axis size does not divide is replicated instead (`mesh_spec`), as is every weight
  of a `FunctionModel`, which carries no names. Weights already laid out by the rules (a
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
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from logitloop.decoding import sampler, transforms
from logitloop.decoding.history import History, distinct_tokens
from logitloop.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from logitloop.ops.sampling.noise import row_keys
from logitloop.ops.sampling.sharded import auto_axes, filter_and_sample_shard, top_k_shard
from logitloop.ops.sampling.xla import scale_logits

DATA_AXIS = "data"
MODEL_AXIS = "model"
# Logical parameter axes laid over the model axis; the rest are replicated.
MODEL_PARALLEL_AXES = frozenset({"heads", "kv_heads", "mlp", "vocab"})
NEG_INF = float("-inf")


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


# ----------------------------------------------------------------------------- weights


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
        lambda w, names: mesh_spec(names if isinstance(names, P) else (), w.shape, model_size),
        weights,
        logical,
    )


def param_shardings(weights: Any, mesh: Mesh) -> Any:
    """`NamedSharding`s for a model's parameters by the logical-axis rules.

    Passing a module gives the tree `restore_converted(..., sharding=...)` expects.
    """
    mesh = as_auto(mesh)
    specs = partition_specs(weights, mesh.shape[MODEL_AXIS])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _put(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def place_weights(weights: Any, mesh: Mesh) -> Any:
    """Lay `weights` (an `nnx.State` or any pytree) over the mesh by the rules."""
    return jax.tree.map(_put, weights, param_shardings(weights, mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an NNX model's parameters onto the mesh in place (once, before generating)."""
    state = nnx.state(model)
    nnx.update(model, place_weights(state, mesh))
    return model


def restore_sharded(directory: str | os.PathLike, mesh: Mesh):
    """Restore a converted model (`save_converted`) with every parameter read straight
    into its shards on `mesh`; no device ever holds a full copy of a sharded weight."""
    from logitloop.models import orbax_io
    from logitloop.models.loading import abstract_model

    _, config, dtype = orbax_io.read_metadata(directory)
    shardings = param_shardings(abstract_model(config, dtype), mesh)
    return orbax_io.restore_converted(directory, sharding=shardings)


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


def _local_ids(ids: jax.Array, offset: jax.Array, width: int) -> jax.Array:
    """Global token ids -> this shard's column, or -1 (the transforms' padding) elsewhere."""
    local = ids - offset
    return jnp.where((ids >= 0) & (local >= 0) & (local < width), local, -1)


def _sample_shard(
    logits_l: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None,
    *,
    axis: str,
    batch_axes: tuple[str, ...],
) -> sampler.SampleOutput:
    """`sampler.sample` on this shard's slice of the vocabulary (inside shard_map)."""
    width = logits_l.shape[1]
    vocab = width * jax.lax.axis_size(axis)
    offset = jax.lax.axis_index(axis).astype(jnp.int32) * width
    all_axes = (*batch_axes, axis)

    def local(ids):
        return _local_ids(ids, offset, width)

    # Steps 1-4 (`sampler.adjust_logits`) with every id list mapped to local columns.
    raw = logits_l.astype(jnp.float32)
    bad_l = jnp.any(jnp.isnan(raw) | (raw == jnp.inf), axis=1)
    bad = jax.lax.pmax(bad_l.astype(jnp.int32), axis) > 0
    z = transforms.allowed_mask(raw, local(params.allowed_ids), params.has_allowed)
    z = transforms.logit_bias(z, local(params.bias_ids), params.bias_values)
    z = transforms.ban_tokens(z, local(params.banned_ids))
    z = transforms.suppress_stop_tokens(
        z, local(params.stop_token_ids), positions, params.min_tokens
    )
    if history is not None:
        seen = distinct_tokens(history)
        ids = seen.ids - offset
        mine = (ids >= 0) & (ids < width)
        seen = seen.replace(ids=jnp.where(mine, ids, 0), is_distinct=seen.is_distinct & mine)
        z = transforms.repetition_penalty(z, seen, params.repetition_penalty)
        z = transforms.presence_frequency_penalty(
            z, seen, params.presence_penalty, params.frequency_penalty
        )
    greedy = (params.temperature == 0) | (params.top_k == 1)
    x = scale_logits(z, jnp.where(greedy, 0.0, params.temperature))
    all_masked = jax.lax.pmax(jnp.max(x, axis=1), axis) == NEG_INF
    status = jnp.where(
        bad,
        sampler.STATUS_BAD_LOGITS,
        jnp.where(all_masked, sampler.STATUS_ALL_MASKED, sampler.STATUS_OK),
    ).astype(jnp.int32)

    # Step 5-8: truncation and draw.
    key = row_keys(params.seed, positions)
    drawn, _ = filter_and_sample_shard(
        x, params.top_k, params.top_p, params.min_p, greedy, key, axis=axis, batch_axes=batch_axes
    )
    batch = x.shape[0]
    ok = status == sampler.STATUS_OK
    tokens = jnp.where(ok, jnp.clip(drawn.tokens, 0, vocab - 1), 0)

    # Raw log-softmax as jax.nn.log_softmax computes it, reduced over the shards.
    raw_safe = jnp.where(jnp.isnan(raw), NEG_INF, raw)
    r = jnp.where(ok[:, None], raw_safe, 0.0)
    shifted = r - jax.lax.pmax(jnp.max(r, axis=1, keepdims=True), axis)
    raw_logp = shifted - jnp.log(
        jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=1, keepdims=True), axis)
    )
    col = tokens - offset
    holds = (col >= 0) & (col < width)
    at_tok = jnp.take_along_axis(raw_logp, jnp.clip(col, 0, width - 1)[:, None], axis=1)[:, 0]
    raw_tok = jax.lax.psum(jnp.where(holds, at_tok, 0.0), axis)

    def top():
        k = min(MAX_TOP_LOGPROBS, vocab)
        vals, ids = top_k_shard(raw_logp, k, axis)
        pad = ((0, 0), (0, MAX_TOP_LOGPROBS - k))
        vals = jnp.pad(vals, pad, constant_values=NEG_INF)
        ids = jnp.pad(ids, pad, constant_values=-1)
        n = jnp.where(ok, params.logprobs, 0)
        keep = jnp.arange(MAX_TOP_LOGPROBS)[None, :] < n[:, None]
        return sampler.TopLogprobs(
            ids=jnp.where(keep, ids, -1).astype(jnp.int32), values=jnp.where(keep, vals, NEG_INF)
        )

    want_top = jax.lax.psum(jnp.any(params.logprobs > 0).astype(jnp.int32), all_axes) > 0
    top_lp = jax.lax.cond(want_top, top, lambda: sampler._no_top_logprobs(batch))
    return sampler.SampleOutput(
        tokens=tokens.astype(jnp.int32),
        logprobs=jnp.where(ok, drawn.logprobs, NEG_INF),
        raw_logprobs=jnp.where(ok, raw_tok, NEG_INF),
        top_logprobs=top_lp,
        status=status,
    )


def sample_sharded(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None = None,
    *,
    mesh: Mesh,
    axis: str = MODEL_AXIS,
    batch_axis: str | None = DATA_AXIS,
) -> sampler.SampleOutput:
    """`sampler.sample` with the vocabulary split over mesh axis `axis`, in one shard_map.

    Every step of the sampler runs on each shard's slice of the logits: masks, bias, bans
    and penalties on the shard's own columns (token ids mapped to local columns), then
    `filter_and_sample_shard`, the raw log-softmax with reduced max and sum, and the top-n
    raw alternatives by per-shard top-k. Only per-row results cross the mesh. The tokens
    equal `sample`'s (see `logitloop.ops.sampling.sharded` for what is exact); the
    log-probabilities agree to float32 rounding. Rows go over `batch_axis` (None:
    replicated); V must be a multiple of the size of `axis` and B of `batch_axis`.
    """
    mesh = auto_axes(mesh)
    batch, vocab = logits.shape
    if vocab % mesh.shape[axis]:
        raise ValueError(f"vocabulary {vocab} is not a multiple of mesh axis {axis!r}")
    if batch_axis is not None and batch % mesh.shape[batch_axis]:
        raise ValueError(f"batch {batch} is not a multiple of mesh axis {batch_axis!r}")
    params = params.device_only()
    positions = jnp.asarray(positions, jnp.int32)
    row = P(batch_axis)
    body = functools.partial(
        _sample_shard, axis=axis, batch_axes=() if batch_axis is None else (batch_axis,)
    )
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(batch_axis, axis), row, row, row),
        out_specs=row,
        check_vma=False,
    )
    return fn(logits, params, positions, history)


def sample(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None,
    mesh: Mesh | None,
) -> sampler.SampleOutput:
    """The decode loop's sampling step: `sample_sharded` when the mesh splits the
    vocabulary (model axis > 1 and dividing V), otherwise `sampler.sample` (GSPMD)."""
    if mesh is not None:
        size = mesh.shape[MODEL_AXIS]
        batch, vocab = logits.shape
        if size > 1 and vocab % size == 0:
            rows = DATA_AXIS if batch % mesh.shape[DATA_AXIS] == 0 else None
            return sample_sharded(logits, params, positions, history, mesh=mesh, batch_axis=rows)
    return sampler.sample(logits, params, positions, history, gspmd=mesh is not None)
