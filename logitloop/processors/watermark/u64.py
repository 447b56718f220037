"""64-bit integer arithmetic on pairs of uint32 arrays (JAX runs without int64 by default).

transformers' watermarks hash in torch int64, which wraps on overflow: a value here is the
pair `(hi, lo)` of its two's complement bits, and every operation wraps modulo 2^64 the
same way. The sign and the floor modulo read `hi` as signed, as torch does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

U64 = tuple[jax.Array, jax.Array]  # (hi, lo), u32 each, same shape


def const(x: int) -> U64:
    """A Python int (any sign, wrapped to 64 bits) as a scalar pair."""
    x &= (1 << 64) - 1
    return jnp.uint32(x >> 32), jnp.uint32(x & 0xFFFFFFFF)


def from_u32(x: jax.Array) -> U64:
    x = x.astype(jnp.uint32)
    return jnp.zeros_like(x), x


def mul_hi(a: jax.Array, b: jax.Array) -> jax.Array:
    """The high 32 bits of the 64-bit product of u32 `a` and `b` (16-bit halves)."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = b & 0xFFFF, b >> 16
    t = a1 * b0 + ((a0 * b0) >> 16)
    u = (t & 0xFFFF) + a0 * b1
    return a1 * b1 + (t >> 16) + (u >> 16)


def add(x: U64, y: U64) -> U64:
    lo = x[1] + y[1]
    return x[0] + y[0] + (lo < x[1]).astype(jnp.uint32), lo


def mul(x: U64, y: U64) -> U64:
    """The low 64 bits of x * y."""
    return mul_hi(x[1], y[1]) + x[0] * y[1] + x[1] * y[0], x[1] * y[1]


def negative(x: U64) -> jax.Array:
    return x[0] >= jnp.uint32(2**31)


def floor_mod(x: U64, m: int) -> jax.Array:
    """[...] i32: the signed int64 `x` modulo `m` (1 <= m <= 2^24), in [0, m), as torch's
    `%` gives it (the sign of the divisor). Horner over 8-bit limbs keeps every partial
    product under 2^32."""
    if not 1 <= m <= 2**24:
        raise ValueError(f"m = {m} is outside the allowed range [1, 2^24]")
    r = jnp.zeros_like(x[1])
    for word in x:
        for shift in (24, 16, 8, 0):
            r = (r * 256 + ((word >> shift) & 0xFF)) % jnp.uint32(m)
    wrap = (1 << 64) % m  # a negative x is its unsigned bits minus 2^64
    r = jnp.where(negative(x), (r + jnp.uint32(m - wrap)) % jnp.uint32(m), r)
    return r.astype(jnp.int32)
