"""Truncation and draw over vocabulary-sharded logits, without gathering the vocabulary.

`filter_and_sample_sharded` is `xla.filter_and_sample` itself, run under `jax.shard_map`
with the vocabulary split over one mesh axis (and, optionally, the rows over another), its
reductions taken over that axis (`xla.Axes`). Each device holds
`x[:, s * V_s : (s + 1) * V_s]` and only small per-row results cross the mesh:

  candidates  each device's top min(C, V_s) (value, global id) -> all_gather -> `lax.top_k`
              of the gathered [B, n * min(C, V_s)]: the same C values and ids, in the same
              order, as `lax.top_k(x, C)` on the whole row (a device holding k of the global
              top C has them among its own top C; the gathered list is ordered by device,
              i.e. by global id, so ties resolve to the lowest id as they do unsharded).
  thresholds  read off the candidates exactly as on one device; the interval searches
              (top_k > C, nuclei wider than C) sum counts (exact integers) and masses
              (float32 partial sums) over the vocabulary axis.
  draw        the exponential race's noise is a function of (row key, global token id), so
              every device scores its own slice; the first maximum over all devices wins:
              the lowest id among equal scores, as `argmax` does.

Greedy rows, top-k rows, min-p rows and the race pick exactly the token the unsharded
operator picks. The one source of difference is the summation order of float32 masses:
top-p compares cumulative masses against `top_p * total`, and `total` (and the masses the
interval search compares) are sums whose order depends on the sharding, so a row whose
nucleus boundary falls within a few ulps of a token's cumulative mass could keep one token
more or less; `log_norm` and `logprobs` of whole-vocabulary draws agree to float32 rounding.

`top_k_sharded` is the candidate step on its own (`lax.top_k` of vocabulary-sharded rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from logitloop.ops.sampling.xla import (
    NUM_CANDIDATES,
    Axes,
    Draw,
    Thresholds,
    candidates,
    filter_and_sample,
)


@functools.lru_cache(maxsize=16)
def _auto_axes(mesh: Mesh) -> Mesh:
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.shape))


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis in Auto (GSPMD) mode: same devices, names and placement.

    `jax.make_mesh` makes Explicit axes by default; these operators run their `shard_map`
    under jit-managed (Auto) shardings, so an Explicit mesh is used as its Auto twin.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return _auto_axes(mesh)


def _check(x: jax.Array, mesh: Mesh, axis: str, batch_axis: str | None) -> None:
    if axis not in mesh.shape:
        raise ValueError(f"axis = {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    n = mesh.shape[axis]
    if x.ndim != 2:
        raise ValueError(f"x must be [B, V], got shape {x.shape}")
    if x.shape[1] % n:
        raise ValueError(
            f"the vocabulary ({x.shape[1]}) must be a multiple of the size of mesh axis "
            f"{axis!r} ({n}) to be sharded over it"
        )
    if batch_axis is not None:
        if batch_axis not in mesh.shape or batch_axis == axis:
            raise ValueError(f"batch_axis = {batch_axis!r} is not another axis of the mesh")
        if x.shape[0] % mesh.shape[batch_axis]:
            raise ValueError(
                f"the batch ({x.shape[0]}) must be a multiple of the size of mesh axis "
                f"{batch_axis!r} ({mesh.shape[batch_axis]})"
            )


def filter_and_sample_sharded(
    x: jax.Array,  # [B, V] f32, scaled logits; NaN-free
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
    *,
    mesh: Mesh,
    axis: str = "model",
    batch_axis: str | None = None,
    num_candidates: int = NUM_CANDIDATES,
) -> tuple[Draw, Thresholds]:
    """`xla.filter_and_sample` with the vocabulary split over mesh axis `axis`.

    The rows are split over `batch_axis` when given (B must be a multiple of its size) and
    replicated over every other mesh axis. V must be a multiple of the size of `axis`.
    Works inside `jit` (GSPMD reshards `x` to `P(batch_axis, axis)` if it is laid out
    otherwise) and eagerly. Returns the same `(Draw, Thresholds)` as the unsharded operator,
    laid out as `P(batch_axis)`; see the module docstring for what is exact.
    """
    _check(x, mesh, axis, batch_axis)
    axes = Axes(vocab=axis, rows=() if batch_axis is None else (batch_axis,))
    row = P(batch_axis)
    body = functools.partial(filter_and_sample, num_candidates=num_candidates, axes=axes)
    fn = jax.shard_map(
        body,
        mesh=auto_axes(mesh),
        in_specs=(P(batch_axis, axis), row, row, row, row, row),
        out_specs=(row, row),
        check_vma=False,
    )
    return fn(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(min_p, jnp.float32),
        jnp.asarray(greedy, bool),
        jnp.asarray(key, jnp.uint32),
    )


def top_k_sharded(
    x: jax.Array, k: int, *, mesh: Mesh, axis: str = "model", batch_axis: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` of vocabulary-sharded rows: the same values and int32 ids, in the
    same order (ties to the lowest id), from per-device top-k and one all_gather."""
    _check(x, mesh, axis, batch_axis)
    axes = Axes(vocab=axis, rows=() if batch_axis is None else (batch_axis,))
    row = P(batch_axis)
    return jax.shard_map(
        lambda x_l: candidates(x_l, min(int(k), x.shape[1]), axes),
        mesh=auto_axes(mesh),
        in_specs=P(batch_axis, axis),
        out_specs=(row, row),
        check_vma=False,
    )(x)
