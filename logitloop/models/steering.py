"""Steering vectors added to the residual stream, per row, as data (activation addition).

A pass's steering (`Steering`, carried in `ll.Rows.steer`) holds up to K vectors per row,
each with the layer after which it is added and a scale:

    vectors: [B, K, E]  float32, zero where a row has fewer than K
    layers:  [B, K]     int32, the decoder layer after which vector k is added (-1: none)
    scales:  [B, K]     float32
    start, stop: [B, K] int32, the positions vector k reaches: start <= p < stop

`add(x, steering, positions, layer)` (what `ll.residual` does after layer `layer`) adds
`sum_k [layers[b, k] == layer] * scales[b, k] * vectors[b, k]` to each token of row b,
over the vectors whose [start, stop) holds the token's position: start 0 and stop the
prompt's length steer the prompt only, start the prompt's length and stop 2**30 the
generated tokens only (the token fed back at
position prompt_len + i, whose residual predicts token i + 1), 0 and 2**30 both. A row
without vectors (or off its positions) adds exact zeros, so it computes what it would
unsteered. The layers are data too: new vectors, scales or layers compile nothing as long
as K (a bucket) is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

EVERYWHERE = 2**30  # `stop` of a row steered to its last generated token


@struct.dataclass
class Steering:
    """The rows' steering vectors (module docstring); every leaf has B rows first."""

    vectors: jax.Array  # [B, K, E] f32
    layers: jax.Array  # [B, K] i32, -1: no vector
    scales: jax.Array  # [B, K] f32
    start: jax.Array  # [B, K] i32
    stop: jax.Array  # [B, K] i32

    @property
    def width(self) -> int:
        """E, the residual stream's width the vectors were made for."""
        return self.vectors.shape[-1]


def add(
    x: jax.Array,  # [B, T, E], the residual stream after layer `layer`
    steering: Steering,
    positions: jax.Array,  # [B, T] i32, -1 for padding
    layer: int,
    rows: jax.Array | None = None,  # [1, N] i32: a packed pass's tokens' rows
) -> jax.Array:
    """`x` plus each row's vectors for `layer` at its steered positions (module docstring).
    In a packed pass (`rows`: x `[1, N, E]` holds the tokens of the `steering`'s rows, token
    n of row `rows[0, n]`) each token gets its own row's vectors."""
    if rows is not None:
        per_token = jax.tree.map(lambda a: a[rows[0]], steering)  # N rows of one token
        return add(x[0][:, None], per_token, positions[0][:, None], layer)[:, 0][None]
    weight = jnp.where(steering.layers == layer, steering.scales, 0.0)  # [B, K]
    pos = positions[:, :, None]  # [B, T, 1]
    on = (pos >= 0) & (pos >= steering.start[:, None]) & (pos < steering.stop[:, None])
    weight = jnp.where(on, weight[:, None, :], 0.0)  # [B, T, K]
    delta = jnp.einsum("btk,bke->bte", weight, steering.vectors)  # [B, T, E] f32
    return x + delta.astype(x.dtype)
