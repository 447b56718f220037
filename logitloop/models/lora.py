"""Many LoRA adapters in one batch: each row adds its own adapter's low-rank update to
the shared base weights (the Punica / S-LoRA way: the base is never copied per adapter).

The table (`LoraTable`, device arrays) holds `slots` adapters of rank up to `rank` for
every target projection ("site") the table was made for, each site stacked side by side:

    a: [K, slots * rank]   slot s's A (as `x @ a`) in columns s*rank .. (s+1)*rank
    b: [slots * rank, N]   slot s's B, already times the adapter's scale, in the same rows

zero-padded to `rank` and zero for an empty slot. A row's update to `x @ w` is computed
one of two ways (`Site.delta`):

- gathered (a slot per row in a prompt pass, or a decode step over more slots than rows,
  outside `deterministic=True`): the row's own `rank` columns of `a` and rows of `b`,
  gathered, in two batched products (Punica's BGMV);
- stacked (under `deterministic=True`, a slot per token, or a decode step over no more
  slots than rows, where it reads fewer bytes than gathering: `Site.stacked_reads_less`):

      delta = select(x @ a, the token's slot's columns) @ b

  two plain 2-D products of `layers.dense` (so a row's bits do not depend on its batch,
  by the same fixed-order tiles as the base's) and one select: the other slots' columns
  become exact zeros, which add nothing to the row's sum. It costs `(K + N) * slots *
  rank` multiply-adds per token against the base's `K * N`.

A base row (slot -1) adds exact zeros. Loading, replacing or removing an adapter writes
the table's values; its shapes never change, so nothing compiles again. A Pallas
segmented gather-matmul (rows sorted by adapter) would serve an accelerator better than
either; not written yet.

Which slot a token reads comes from the pass (`kv.rows.adapter`, `ll.Rows`): `[B]` (one
slot per row; each of the row's T tokens reads it) or `[B, T]` (one per token: a packed
pass whose tokens `[1, N]` come from many rows gives each token its row's slot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.models import layers
from logitloop.models.fixed_order import Numerics


def site_name(layer: int, target: str) -> str:
    """The table's key of one target projection: `"3.q_proj"`."""
    return f"{layer}.{target}"


@struct.dataclass
class LoraTable:
    """Every site's stacked adapters (module docstring): `sites[name] = (a [K, S * R],
    b [S * R, N])`, S = `slots`, R = `rank` (static)."""

    sites: dict[str, tuple[jax.Array, jax.Array]]
    slots: int = struct.field(pytree_node=False, default=1)
    rank: int = struct.field(pytree_node=False, default=1)


@dataclasses.dataclass(frozen=True)
class Site:
    """One projection's adapters for one pass: the table's `a`, `b`, and each token's slot
    (`index`, broadcastable to x's leading axes; -1 for the base)."""

    a: jax.Array  # [K, S * R]
    b: jax.Array  # [S * R, N]
    index: jax.Array  # [B] or [B, T] int32
    rank: int

    def delta(self, x: jax.Array, *, groups: int, numerics: Numerics) -> jax.Array:
        """`[..., K] -> [..., N]`: each token's adapter update (zero for slot -1)."""
        lead = x.shape[:-1]
        per_row = self.index.ndim == 1 and lead and lead[0] == len(self.index)
        if not numerics.fixed and per_row and not self.stacked_reads_less(lead):
            return self.gathered(x)
        index = self.index.reshape(self.index.shape + (1,) * (len(lead) - self.index.ndim))
        index = jnp.broadcast_to(index, lead)  # [..., ] one slot per token
        xa = layers.dense(x, self.a.astype(x.dtype), groups=groups, numerics=numerics)
        column_slot = jnp.arange(self.a.shape[1]) // self.rank  # [S * R]
        mine = index[..., None] == column_slot  # [..., S * R]
        xa = jnp.where(mine, xa, jnp.zeros((), xa.dtype))
        return layers.dense(xa, self.b.astype(x.dtype), numerics=numerics)

    def stacked_reads_less(self, lead: tuple[int, ...]) -> bool:
        """Whether the stacked way moves fewer bytes for rows of `lead` (`[B, ...]`): a
        decode step (one token a row) over no more slots than rows reads the table once,
        `S * R * (K + N)`, where gathering copies `B * R * (K + N)`; its extra products are
        one token's each, so the step stays bound by memory. A longer pass (a prompt) keeps
        gathering: stacking would multiply its products by `S`."""
        slots = self.a.shape[1] // self.rank
        return math.prod(lead[1:]) == 1 and slots <= lead[0]

    def gathered(self, x: jax.Array) -> jax.Array:
        """`delta` with one slot per row (`index [B]`, x `[B, ..., K]`): each row's own
        A and B gathered (`rank` columns, not every slot's), in two batched products.
        Not under `deterministic=True`, whose fixed-order tiles take 2-D products."""
        k, n, rank = self.a.shape[0], self.b.shape[1], self.rank
        slots = self.a.shape[1] // rank
        slot = jnp.clip(self.index, 0, slots - 1)  # [B]
        a = self.a.reshape(k, slots, rank)[:, slot].astype(x.dtype)  # [K, B, R]
        b = self.b.reshape(slots, rank, n)[slot].astype(x.dtype)  # [B, R, N]
        rows = x.reshape(x.shape[0], -1, k)  # [B, M, K]
        xa = jnp.einsum("bmk,kbr->bmr", rows, a)
        xa = jnp.where((self.index >= 0)[:, None, None], xa, jnp.zeros((), xa.dtype))
        return jnp.einsum("bmr,brn->bmn", xa, b).reshape(*x.shape[:-1], n)


def site(rows: Any, layer: int, target: str) -> Site | None:
    """The `Site` of projection `target` of layer `layer` in a pass carrying `rows`
    (`ll.Rows`), or None when the pass has no adapter table or the table no such site."""
    table = None if rows is None else rows.lora
    if table is None:
        return None
    pair = table.sites.get(site_name(layer, target))
    if pair is None:
        return None
    return Site(pair[0], pair[1], rows.adapter, table.rank)
