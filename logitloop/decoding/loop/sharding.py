"""Generation over a device mesh: rows over a "data" axis, weights over a "model" axis.

`generate(model, prompts, params, mesh=mesh)` (and `stream`, `generate_many`) run the same
prefill and decode loop as on one device, handed a `MeshLayout` (`layout_for(mesh)`) instead
of `layout.ONE_DEVICE`, over a `jax.sharding.Mesh` with axes "data" and "model":

- Rows go over "data". The batch is padded to a multiple of the data-axis size with dummy
  rows (copies of row 0 that stop after one token) which never reach the result.
- Weights go over "model" by their logical axis names, by the rules that live with the
  models (`logitloop.models.partitioning`, re-exported here): "heads", "kv_heads", "mlp"
  and "vocab" map to "model", the rest is replicated, as is every weight of a
  `FunctionModel`, which carries no names. Weights already laid out by the rules (a
  `restore_sharded` model, or `shard_model`) are not moved; others are `device_put`.
- The KV cache (`[B, H, S, D]` per layer and per k/v) has its rows over "data" and its
  heads over "model" when the head count is divisible, like the k/v projections. A paged
  pool (`generate_many(..., kv_cache_tokens=N)`, `[Hkv, pages, page_size, D]`) has its
  heads over "model" the same way and its pages over "data": one pool of N / d pages per
  data shard, from which only that shard's rows take pages (`pages.PageState.shards`),
  so a row's reads and writes stay on its devices (`layers.by_page_shard`) and a data
  axis of d divides the pool's memory by d. The page tables, `[B, P]`, go over "data"
  with the rows.
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from logitloop.decoding.loop.layout import ONE_DEVICE, Layout
from logitloop.decoding.sampling import sampler
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.orbax_io import restore_sharded  # noqa: F401 - re-exported
from logitloop.models.partitioning import (  # noqa: F401 - re-exported: the mesh API in one place
    DATA_AXIS,
    MODEL_AXIS,
    param_shardings,
    place_weights,
    put,
    shard_model,
)
from logitloop.ops.sampling.sharded import auto_axes
from logitloop.ops.sampling.xla import Axes

# ----------------------------------------------------------------------------- the mesh


def as_auto(mesh: Mesh) -> Mesh:
    """Check `mesh` and return it with every axis in `AxisType.Auto` (GSPMD) mode.

    `jax.make_mesh` makes Explicit axes by default; the decode loop lays arrays out with
    sharding constraints and lets GSPMD propagate them, which needs Auto axes. The devices
    and axis names are kept, so shardings built on either mesh place data identically.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh)!r}")
    missing = [a for a in (DATA_AXIS, MODEL_AXIS) if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"mesh has axes {tuple(mesh.axis_names)}; it needs a {DATA_AXIS!r} axis (rows) "
            f"and a {MODEL_AXIS!r} axis (weights); give unused ones size 1"
        )
    return auto_axes(mesh)


def layout_for(mesh: Mesh | None, *, whole_vocab: bool = False) -> Layout:
    """The loop's layout for `generate(..., mesh=mesh)`: `ONE_DEVICE` for None.
    `whole_vocab`: the sampler never splits the vocabulary (`MeshLayout.whole_vocab`)."""
    return ONE_DEVICE if mesh is None else MeshLayout(as_auto(mesh), whole_vocab=whole_vocab)


POOL_KEYS = ("k_pages", "v_pages")  # a paged pool's arrays in a layer's cache dict


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


@dataclasses.dataclass(frozen=True)
class MeshLayout(Layout):
    """The loop over a mesh with axes "data" (rows) and "model" (weights, KV heads, vocab)."""

    mesh: Mesh  # every axis Auto (`as_auto`)
    # The sampler runs on whole rows of the vocabulary, gathered over "model", never on
    # slices of it: its sums over the vocabulary then have the one-device order
    # (`deterministic="model-parallel"`; a split vocabulary adds per-device partial sums).
    whole_vocab: bool = False

    @property
    def row_mesh(self) -> Mesh:
        return self.mesh

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def row_shardings(self, tree: Any, batch: int) -> Any:
        """Leaves with a leading axis of length `batch` over "data", the rest replicated."""
        return jax.tree.map(lambda x: self._named(_row_spec(x, batch)), tree)

    def cache_shardings(self, cache: Any, batch: int) -> Any:
        size = self.mesh.shape[MODEL_AXIS]

        shards = self.mesh.shape[DATA_AXIS]

        def spec(path, x):
            if getattr(path[-1], "key", None) in POOL_KEYS:  # a paged pool (module docstring)
                heads, pages = np.shape(x)[:2]
                return self._named(
                    P(
                        MODEL_AXIS if size > 1 and heads % size == 0 else None,
                        DATA_AXIS if shards > 1 and pages % shards == 0 else None,
                    )
                )
            return self._named(_cache_spec(x, batch, size))

        return jax.tree_util.tree_map_with_path(spec, cache)

    def rows(self, tree: Any, batch: int | None = None) -> Any:
        if batch is None:
            batch = np.shape(jax.tree.leaves(tree)[0])[0]
        return jax.lax.with_sharding_constraint(tree, self.row_shardings(tree, batch))

    def cache(self, cache: Any, batch: int) -> Any:
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache, batch))

    def state(self, state: Any) -> Any:
        batch = state.tokens.shape[0]
        rest = self.rows(state.replace(cache=None), batch)
        return rest.replace(cache=self.cache(state.cache, batch))

    def sample(
        self,
        logits: jax.Array,
        params: SamplingParams,
        positions: jax.Array,
        history: History | None,
        states: tuple = (),
        done: jax.Array | None = None,
        allowed_bits: jax.Array | None = None,
        choose=None,
    ) -> sampler.SampleOutput:
        """`sampler.sample_step` under `shard_map`: the vocabulary over "model" when its size
        divides V, no processor needs whole rows and the layout is not `whole_vocab`, the
        rows over "data" when its size divides B. (`choose` must be None: speculation does
        not run on a mesh.)"""
        if choose is not None:
            raise ValueError("speculative decoding does not run on a mesh")
        batch, vocab = logits.shape
        size = self.mesh.shape[MODEL_AXIS]
        split = size > 1 and vocab % size == 0 and not params.processors and not self.whole_vocab
        rows = DATA_AXIS if batch % self.mesh.shape[DATA_AXIS] == 0 else None
        return sample_sharded(
            logits,
            params,
            positions,
            history,
            states=states,
            done=done,
            allowed_bits=allowed_bits,
            mesh=self.mesh,
            axis=MODEL_AXIS if split else None,
            batch_axis=rows,
        )

    def place(self, info: Any) -> Any:
        """Weights onto the mesh by the models' partition rules."""
        return dataclasses.replace(info, weights=place_weights(info.weights, self.mesh))

    def place_rows(self, rows: Any) -> Any:
        """The rows' LoRA adapter table (`Rows.lora`) replicated on every device, each
        row's adapter slot and steering vectors over "data" with the rows (replicated
        where the data axis does not divide them). Arrays already there do not move."""
        if rows is None:
            return None
        shards = self.mesh.shape[DATA_AXIS]

        def row(x: Any) -> Any:
            split = np.ndim(x) >= 1 and np.shape(x)[0] % shards == 0
            return put(x, self._named(P(DATA_AXIS) if split else P()))

        lora = jax.tree.map(lambda x: put(x, self._named(P())), rows.lora)
        return rows.replace(
            adapter=jax.tree.map(row, rows.adapter), lora=lora, steer=jax.tree.map(row, rows.steer)
        )

    @property
    def row_multiple(self) -> int:
        return self.mesh.shape[DATA_AXIS]

    def host_view(self, tree: Any) -> Any:
        """On one host every array is readable; across hosts, arrays spanning other
        processes' devices are replicated first (every process must call this alike). A
        `DecodeState`'s cache is dropped: the host never reads it."""
        if hasattr(tree, "cache") and hasattr(tree, "replace"):
            tree = tree.replace(cache=None)
        leaves = jax.tree.leaves(tree)
        if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
            return tree
        return jax.jit(lambda t: t, out_shardings=self._named(P()))(tree)


# ----------------------------------------------------------------------------- sampling


def sample_sharded(
    logits: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
    history: History | None = None,
    *,
    states: tuple = (),
    done: jax.Array | None = None,
    allowed_bits: jax.Array | None = None,
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
    num_top = params.top_logprobs_width  # as `sample`: static, the widest row's logprobs

    def step(logits, params, positions, history, states, done, allowed_bits):
        rows = dict(states=states, done=done, allowed_bits=allowed_bits, num_top=num_top)
        return sampler.sample_step(logits, params, positions, history, axes=axes, **rows)

    fn = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(batch_axis, axis), row, row, row, row, row, row),
        out_specs=row,
        check_vma=False,
    )
    done = jnp.zeros((batch,), bool) if done is None else done
    positions = jnp.asarray(positions, jnp.int32)
    return fn(logits, params.device_only(), positions, history, tuple(states), done, allowed_bits)
