"""Truncation and draw over vocabulary-sharded logits, without gathering the vocabulary.

`filter_and_sample_sharded` is `xla.filter_and_sample` run under `jax.shard_map` with the
vocabulary split over one mesh axis (and, optionally, the rows over another). Each shard
holds `x[:, s * V_s : (s + 1) * V_s]` and only small per-row results cross the mesh:

  candidates  each shard's top min(C, V_s) (value, global id) -> all_gather -> `lax.top_k`
              of the gathered [B, n * min(C, V_s)]: the same C values and ids, in the same
              order, as `lax.top_k(x, C)` on the whole row (a shard holding k of the global
              top C has them among its own top C; the gathered list is ordered by shard,
              i.e. by global id, so ties resolve to the lowest id as they do unsharded).
  thresholds  read off the candidates exactly as `xla.thresholds` does; the bisection
              fallbacks (top_k > C, nuclei wider than C) count with `psum` of per-shard
              counts (exact integers) or masses (float32 partial sums).
  draw        the exponential race's noise is a function of (row key, global token id), so
              every shard scores its own slice; each shard's best (score, id) is gathered
              and the first maximum wins: the lowest id among equal scores, as `argmax` does.

Greedy rows, top-k rows, min-p rows and the race pick exactly the token the unsharded
operator picks. The one source of difference is the summation order of float32 masses:
top-p compares cumulative masses against `top_p * total`, and `total` (and the masses the
bisection compares) are sums whose order depends on the sharding, so a row whose nucleus
boundary falls within a few ulps of a token's cumulative mass could keep one token more or
less; `log_norm` and `logprobs` of whole-vocabulary draws agree to float32 rounding.

`top_k_sharded` is the candidate step on its own (`lax.top_k` of vocabulary-sharded rows).
`filter_and_sample_shard` and `top_k_shard` are the per-shard bodies, for callers that run
their own `shard_map` (`logitloop.decoding.sharding.sample_sharded` fuses the whole
sampling step into one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from logitloop.ops.sampling.xla import (
    NEG_INF,
    NUM_CANDIDATES,
    Draw,
    Thresholds,
    key_to_float,
    race_scores,
    rules_off_on_greedy,
    sortable_key,
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


def _any_everywhere(pred: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """jnp.any over the whole (global) batch, the same on every shard.

    `lax.cond` branches holding collectives must be taken by every participant alike.
    """
    return jax.lax.psum(jnp.any(pred).astype(jnp.int32), axes) > 0


def top_k_shard(x_l: jax.Array, c: int, axis: str) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map: the global top c (values, int32 global ids) of each row, the same
    on every shard of `axis` and equal to `lax.top_k` of the whole row."""
    v_l = x_l.shape[1]
    offset = jax.lax.axis_index(axis) * v_l
    vals, idx = jax.lax.top_k(x_l, min(c, v_l))
    ids = idx.astype(jnp.int32) + offset.astype(jnp.int32)
    all_vals = jax.lax.all_gather(vals, axis, axis=1, tiled=True)  # [B, n * c_l], shard order
    all_ids = jax.lax.all_gather(ids, axis, axis=1, tiled=True)
    top_vals, pos = jax.lax.top_k(all_vals, c)
    return top_vals, jnp.take_along_axis(all_ids, pos, axis=1)


def _largest_threshold(stat_fn, x_l: jax.Array, target: jax.Array, axis: str) -> jax.Array:
    """`xla.largest_threshold` over a sharded vocabulary: stat_fn is psum'd over `axis`."""
    keys = sortable_key(x_l)

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + ((hi - lo) >> 1) + ((hi - lo) & 1)
        ok = jax.lax.psum(stat_fn(keys >= mid[:, None]), axis) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jax.lax.pmin(jnp.min(keys, axis=1), axis)
    hi = jax.lax.pmax(jnp.max(keys, axis=1), axis)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return key_to_float(lo)


def _thresholds(x_l, top_k, top_p, min_p, cand_x, vocab, axis, all_axes) -> Thresholds:
    """`xla.thresholds` with the vocabulary-wide statistics reduced over `axis`."""
    c = cand_x.shape[1]
    row_max = cand_x[:, 0]

    k_on = (top_k > 0) & (top_k < vocab)
    k_in_cand = k_on & (top_k <= c)
    t_k_cand = jnp.take_along_axis(cand_x, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=1)[:, 0]
    k_far = k_on & ~k_in_cand
    t_k_far = jax.lax.cond(
        _any_everywhere(k_far, all_axes),
        lambda: _largest_threshold(
            lambda m: jnp.sum(m, axis=1, dtype=jnp.int32), x_l, jnp.where(k_far, top_k, 1), axis
        ),
        lambda: jnp.full_like(row_max, NEG_INF),
    )
    t_k = jnp.where(k_in_cand, t_k_cand, jnp.where(k_far, t_k_far, NEG_INF))

    p_on = top_p < 1.0
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[:, None]
    survivors = x_l >= t_k[:, None]
    weights = jnp.where(survivors, jnp.exp(x_l - safe_max), 0.0)  # [B, V_s]
    target = top_p * jax.lax.psum(jnp.sum(weights, axis=1), axis)
    cand_w = jnp.where(cand_x >= t_k[:, None], jnp.exp(cand_x - safe_max), 0.0)
    cum = jnp.cumsum(cand_w, axis=1)
    reach = jnp.sum(cum < target[:, None], axis=1)
    p_in_cand = p_on & (reach < c)
    t_p_cand = jnp.take_along_axis(cand_x, jnp.minimum(reach, c - 1)[:, None], axis=1)[:, 0]
    p_far = p_on & ~p_in_cand
    t_p_far = jax.lax.cond(
        _any_everywhere(p_far, all_axes),
        lambda: _largest_threshold(
            lambda m: jnp.sum(jnp.where(m, weights, 0.0), axis=1),
            x_l,
            jnp.where(p_far, target, 0.0),
            axis,
        ),
        lambda: jnp.full_like(row_max, NEG_INF),
    )
    t_p = jnp.where(p_in_cand, t_p_cand, jnp.where(p_far, t_p_far, NEG_INF))

    t_m = jnp.where(min_p > 0, row_max + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), NEG_INF)
    return Thresholds(row_max=row_max, top_k=t_k, top_p=t_p, min_p=t_m)


def _draw(x_l, thr, cand_x, cand_i, greedy, key, vocab, axis, all_axes) -> Draw:
    """`xla.draw` with the whole-vocabulary race and sums split over `axis`."""
    batch, v_l = x_l.shape
    c = cand_x.shape[1]
    offset = (jax.lax.axis_index(axis) * v_l).astype(jnp.int32)
    t = thr.kept[:, None]
    m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)[:, None]
    inside = (thr.kept > cand_x[:, -1]) | (c == vocab)

    # The candidates are the same on every shard: this part is `xla.draw` verbatim.
    cand_log_w = jnp.where(cand_x >= t, cand_x - m, NEG_INF)
    pick = jnp.argmax(race_scores(cand_log_w, key, cand_i.astype(jnp.uint32)), axis=1)
    cand_tok = jnp.take_along_axis(cand_i, pick[:, None], axis=1)[:, 0]
    cand_norm = jax.nn.logsumexp(cand_log_w, axis=1) + m[:, 0]

    def whole_vocab():
        log_w = jnp.where(x_l >= t, x_l - m, NEG_INF)  # [B, V_s]
        ids = (jnp.arange(v_l, dtype=jnp.int32) + offset).astype(jnp.uint32)[None, :]
        scores = race_scores(log_w, key, ids)
        loc = jnp.argmax(scores, axis=1)
        best = jnp.take_along_axis(scores, loc[:, None], axis=1)  # [B, 1]
        all_best = jax.lax.all_gather(best, axis, axis=1, tiled=True)  # [B, n]
        all_ids = jax.lax.all_gather(
            loc[:, None].astype(jnp.int32) + offset, axis, axis=1, tiled=True
        )
        winner = jnp.argmax(all_best, axis=1)  # first maximum = lowest shard = lowest id
        tok = jnp.take_along_axis(all_ids, winner[:, None], axis=1)[:, 0]
        # logsumexp as jax.nn.logsumexp computes it, with the sum reduced over shards.
        mx = jax.lax.pmax(jnp.max(log_w, axis=1), axis)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        total = jax.lax.psum(jnp.sum(jnp.exp(log_w - mx[:, None]), axis=1), axis)
        return tok, jnp.log(total) + mx + m[:, 0]

    far_tok, far_norm = jax.lax.cond(
        _any_everywhere(~inside & ~greedy, all_axes),
        whole_vocab,
        lambda: (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32)),
    )
    tokens = jnp.where(greedy, cand_i[:, 0], jnp.where(inside, cand_tok, far_tok))
    log_norm = jnp.where(inside, cand_norm, far_norm)
    local = tokens - offset
    mine = (local >= 0) & (local < v_l)
    x_mine = jnp.take_along_axis(x_l, jnp.clip(local, 0, v_l - 1)[:, None], axis=1)[:, 0]
    x_tok = jax.lax.psum(jnp.where(mine, x_mine, 0.0), axis)  # one shard holds it
    logprobs = jnp.where(greedy, 0.0, x_tok - log_norm)
    return Draw(tokens=tokens.astype(jnp.int32), logprobs=logprobs, log_norm=log_norm)


def filter_and_sample_shard(
    x_l: jax.Array,  # [B_s, V_s] f32, this shard's slice of the scaled logits
    top_k: jax.Array,  # [B_s] i32
    top_p: jax.Array,  # [B_s] f32
    min_p: jax.Array,  # [B_s] f32
    greedy: jax.Array,  # [B_s] bool
    key: jax.Array,  # [B_s, 2] u32
    *,
    axis: str,
    batch_axes: tuple[str, ...] = (),
    num_candidates: int = NUM_CANDIDATES,
) -> tuple[Draw, Thresholds]:
    """The per-shard body of `filter_and_sample_sharded`, for use inside `jax.shard_map`.

    `x_l` is this shard's contiguous slice of the vocabulary along mesh axis `axis`
    (shard s holds ids [s * V_s, (s + 1) * V_s)); `batch_axes` are the mesh axes the rows
    are split over (so that branch decisions see the whole batch). The results are the
    same on every shard of `axis`.
    """
    vocab = x_l.shape[1] * jax.lax.axis_size(axis)
    c = min(num_candidates, vocab)
    all_axes = (*batch_axes, axis)
    cand_x, cand_i = top_k_shard(x_l, c, axis)
    thr = _thresholds(x_l, top_k, top_p, min_p, cand_x, vocab, axis, all_axes)
    drawn = _draw(x_l, thr, cand_x, cand_i, greedy, key, vocab, axis, all_axes)
    return drawn, thr


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
    # As in the unsharded operator, the filters are not evaluated on greedy rows.
    top_k, top_p, min_p = rules_off_on_greedy(top_k, top_p, min_p, greedy)
    mesh = auto_axes(mesh)
    row = P(batch_axis)
    body = functools.partial(
        filter_and_sample_shard,
        axis=axis,
        batch_axes=() if batch_axis is None else (batch_axis,),
        num_candidates=num_candidates,
    )
    fn = jax.shard_map(
        body,
        mesh=mesh,
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
    same order (ties to the lowest id), from per-shard top-k and one all_gather."""
    _check(x, mesh, axis, batch_axis)
    mesh = auto_axes(mesh)
    row = P(batch_axis)
    return jax.shard_map(
        lambda x_l: top_k_shard(x_l, min(int(k), x.shape[1]), axis),
        mesh=mesh,
        in_specs=P(batch_axis, axis),
        out_specs=(row, row),
        check_vma=False,
    )(x)
