"""Counter-based random numbers shared by every sampling backend.

A row's random stream is its key (derived from `(seed, position)` with `jax.random.fold_in`)
hashed with a counter, so the XLA path and the Pallas kernel can produce the same noise for
the same (row, counter) without passing noise arrays around, and a row's noise never depends
on other rows.

The draws are exponential races: the winner of `argmin_i E_i / w_i` with `E_i ~ Exp(1)` is
token `i` with probability `w_i / sum(w)`. Small `E` decides whether a tail token can win,
so `E` is built as `-log1p(-u)` from a 32-bit `u` that keeps full relative precision near 0:
the smallest `E` is about 2^-33, which lets tokens with mass down to ~2^-32 of the row win
at the right rate. (A naive `-log(u)` from a 24-bit float uniform bottoms out at 2^-24 and
never picks tokens below that share of the mass.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit finaliser with good avalanche (Wellons' `lowbias32`)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def counter_bits(key: jax.Array, counter: jax.Array) -> jax.Array:
    """32 random bits for each (row key, counter).

    key: [..., 2] uint32 (one row key, broadcast against `counter`'s leading axes);
    counter: uint32 array. Returns uint32 with `counter`'s shape.
    """
    k0 = key[..., 0]
    k1 = key[..., 1]
    c = counter.astype(jnp.uint32)
    h = _mix32(c * jnp.uint32(0x9E3779B9) + k1)
    h = _mix32(h ^ k0)
    return _mix32(h + c)


def exponential_from_bits(bits: jax.Array) -> jax.Array:
    """Exp(1) noise from 32 random bits, fine-grained near 0 (see module docstring)."""
    u = bits.astype(jnp.float32) * jnp.float32(2.0**-32) + jnp.float32(2.0**-33)
    u = jnp.minimum(u, jnp.float32(1.0 - 2.0**-24))  # float rounding can reach 1.0
    return -jnp.log1p(-u)


def row_keys(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """[B] seeds, [B] positions -> [B, 2] uint32 keys: fold_in(key(seed), position)."""

    def one(s, p):
        return jax.random.key_data(jax.random.fold_in(jax.random.key(s), p))

    return jax.vmap(one)(seed.astype(jnp.uint32), positions.astype(jnp.uint32)).astype(jnp.uint32)
