"""Where the decode loop's arrays live: one device, or a mesh (`sharding.MeshLayout`).

The device loop (`logitloop.decoding.loop.decode_loop`) takes a layout as a static argument
(in its `Program`) and asks it at a few fixed points to pin arrays to their places (`rows`,
`cache`, `state`) and to run the sampling step (`sample`); the host side asks it to place
the weights (`place`), how a batch's rows must divide (`row_multiple`) and to make results
readable (`host_view`). `ONE_DEVICE` does nothing at those points and runs
`sampler.sample_step` as is, so the single-device path never consults the mesh code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from logitloop.decoding.sampling import sampler
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Layout:
    """One device: every array where jit puts it; the sampling step as written."""

    def rows(self, tree: Any, batch: int | None = None) -> Any:
        """Inside jit: pin a pytree of per-row arrays."""
        return tree

    def cache(self, cache: Any, batch: int) -> Any:
        """Inside jit: pin a KV cache."""
        return cache

    def state(self, state: Any) -> Any:
        """Inside jit: pin a `DecodeState`."""
        return state

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
        """The loop's sampling step (`states`, `done`: for the processors; `allowed_bits`:
        the constraints' masks; `choose`: see `sampler.sample_step`)."""
        rows = dict(states=states, done=done, allowed_bits=allowed_bits, choose=choose)
        return sampler.sample_step(logits, params, positions, history, **rows)

    def place(self, info: Any) -> Any:
        """Host side: the model (`ModelInfo`) with its weights where the loop reads them."""
        return info

    def place_rows(self, rows: Any) -> Any:
        """Host side: the rows' per-row model state (`ll.Rows`, or None) where the loop
        reads it."""
        return rows

    @property
    def row_mesh(self) -> Any:
        """The mesh whose "data" axis holds the rows (None: one device)."""
        return None

    @property
    def row_multiple(self) -> int:
        """A batch's row count must be a multiple of this (the mesh's data-axis size)."""
        return 1

    def check_rows(self, name: str, rows: int) -> None:
        """Host side: a fixed row count (`generate_many`'s slots) the layout can hold."""
        if rows % self.row_multiple:
            raise ValueError(
                f"{name} = {rows} must be a multiple of {self.row_multiple}, the size of the "
                "mesh's data axis"
            )

    def host_view(self, tree: Any) -> Any:
        """Host side: arrays `jax.device_get` can read in this process."""
        return tree


ONE_DEVICE = Layout()
