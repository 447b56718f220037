"""What torch's CPU random generator draws, in JAX: the watermarks' greenlists and tables.

transformers builds its watermarks from `torch.Generator` (CPU): `manual_seed(s)` seeds a
32-bit Mersenne Twister (MT19937) with the low 32 bits of `s`, each `random()` is one
tempered 32-bit output, and

- `torch.randperm(n)` (n < 2^32 / 20) is a Fisher-Yates shuffle: r = [0, 1, ..., n-1],
  then for k = 0 .. n-2 swap r[k] and r[k + z_k] with z_k = random() % (n - k);
- `torch.randint(0, 2, (S,))` is `random() % 2` per entry.

`randperm_prefix` gives the first `length` entries of the shuffle without its sequential
loop (a greenlist is the first `gamma * n` of them). Step k only writes positions >= k, so
r[k] is final after step k. With j_k = k + z_k:

- pre(p), the value at position p just before step p, is p unless an earlier step k wrote
  it (j_k = p, k < p), and then it is pre(k) of the latest such k: a chain of pointers to
  earlier steps, resolved by pointer doubling (log2(length) gathers);
- r[k] is the value at position j_k just before step k: pre(q) for the latest step q < k
  with j_q = j_k (found by a stable sort of j), else j_k itself (never touched).

Worked example, n = 4, z = [2, 0, 1]: j = [2, 1, 3]. Step 0 swaps 0 and 2 ([2, 1, 0, 3]),
step 1 keeps 1, step 2 swaps 2 and 3 ([2, 1, 3, 0]). By the rules: r[0] = j_0 = 2; r[1] =
j_1 = 1; r[2] = j_2 = 3 (position 3 was never written); and pre(2) = pre(0) = 0 (step 0
wrote position 2), which is where the 0 went: the last entry.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_N, _M = 624, 397
_MATRIX_A = 0x9908B0DF
_UPPER, _LOWER = 0x80000000, 0x7FFFFFFF


def _u32(x: int) -> jax.Array:
    return jnp.uint32(x)


def _seed_state(seed: jax.Array) -> jax.Array:  # [N] u32 -> [N, 624] u32
    """MT19937's `init_genrand`: mt[i] = 1812433253 * (mt[i-1] ^ (mt[i-1] >> 30)) + i."""

    def step(x, i):
        x = _u32(1812433253) * (x ^ (x >> 30)) + i
        return x, x

    idx = jnp.arange(1, _N, dtype=jnp.uint32)
    _, rest = jax.lax.scan(step, seed.astype(jnp.uint32), idx)  # [623, N]
    return jnp.concatenate([seed.astype(jnp.uint32)[:, None], rest.T], axis=1)


def _twist(mt: jax.Array) -> jax.Array:  # [N, 624] u32 -> the next [N, 624]
    """One `next_state`: new[i] = mt[i + 397] ^ mix(mt[i], mt[i + 1]), where indices past
    623 read the new values; done in the four runs whose inputs are ready."""

    def mix(cur, nxt, far):
        y = (cur & _u32(_UPPER)) | (nxt & _u32(_LOWER))
        return far ^ (y >> 1) ^ jnp.where((y & 1) == 1, _u32(_MATRIX_A), _u32(0))

    k = _N - _M  # 227
    a = mix(mt[:, 0:k], mt[:, 1 : k + 1], mt[:, _M:_N])  # i in [0, 227): all old
    b = mix(mt[:, k : 2 * k], mt[:, k + 1 : 2 * k + 1], a)  # far = new[i - 227]
    c = mix(mt[:, 2 * k : _N - 1], mt[:, 2 * k + 1 : _N], b[:, : _N - 1 - 2 * k])
    d = mix(mt[:, _N - 1 :], a[:, :1], b[:, _N - 1 - 2 * k : _N - 2 * k])  # i = 623
    return jnp.concatenate([a, b, c, d], axis=1)


def _temper(y: jax.Array) -> jax.Array:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & _u32(0x9D2C5680))
    y = y ^ ((y << 15) & _u32(0xEFC60000))
    return y ^ (y >> 18)


def random_u32(seed: jax.Array, count: int) -> jax.Array:  # [N] u32 -> [N, count] u32
    """The first `count` values of `random()` after `manual_seed(seed)`, per seed."""
    blocks = max(1, math.ceil(count / _N))

    def block(mt, _):
        mt = _twist(mt)
        return mt, _temper(mt)

    _, out = jax.lax.scan(block, _seed_state(seed), None, length=blocks)  # [T, N, 624]
    return jnp.moveaxis(out, 0, 1).reshape(seed.shape[0], blocks * _N)[:, :count]


def randperm_prefix(seed: jax.Array, n: int, length: int) -> jax.Array:
    """[N] u32 seeds -> [N, length] i32: `torch.randperm(n, generator=g)[:length]` with
    `g.manual_seed(seed)`, per seed (1 <= length <= n - 1; see the module docstring)."""
    if not 1 <= length <= n - 1:
        raise ValueError(f"length = {length} is outside the allowed range [1, {n - 1}]")
    rows = seed.shape[0]
    k = jnp.arange(length, dtype=jnp.int32)  # [L]
    z = random_u32(seed, length) % (jnp.uint32(n) - k.astype(jnp.uint32))  # [N, L]
    j = k + z.astype(jnp.int32)  # [N, L], the position step k swaps with k
    # Latest earlier step that wrote each position p < L (-1: none).
    wrote = (j > k) & (j < length)
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], j.shape)
    writer = jnp.full((rows, length), -1, jnp.int32)
    writer = writer.at[row, jnp.where(wrote, j, length)].max(k, mode="drop")
    pre = jnp.where(writer >= 0, writer, k)  # pointers to earlier steps; roots point home
    pre = jax.lax.while_loop(  # pointer doubling until every pointer reaches its root
        lambda p: jnp.any(jnp.take_along_axis(p, p, axis=1) != p),
        lambda p: jnp.take_along_axis(p, p, axis=1),
        pre,
    )
    # Latest earlier step with the same target: the neighbour in a sort of (j, k), packed
    # into one int32 key where it fits (XLA:CPU sorts one array many times faster).
    if n * length < 2**31:
        packed = jnp.sort(j * length + k, axis=1)
        sj, order = packed // length, packed % length
    else:
        sj, order = jax.lax.sort((j, jnp.broadcast_to(k, j.shape)), dimension=1, num_keys=2)
    same = jnp.concatenate([jnp.zeros((rows, 1), bool), sj[:, 1:] == sj[:, :-1]], axis=1)
    prev = jnp.concatenate([jnp.full((rows, 1), -1, jnp.int32), order[:, :-1]], axis=1)
    q = jnp.zeros_like(j).at[row, order].set(jnp.where(same, prev, -1).astype(jnp.int32))
    return jnp.where(q >= 0, jnp.take_along_axis(pre, jnp.maximum(q, 0), axis=1), j)


def in_prefix(seed: jax.Array, token: jax.Array, size: jax.Array, n: int) -> jax.Array:
    """[N] bool: `token` [N] is among the first `size` [N] entries of `randperm(n)` seeded
    with `seed` [N] (size <= n - 1), without building the permutation.

    Follow the token through the shuffle: it sits at position `pos` (first its own
    value) from step `t` on. The first step i in [t, pos) with j_i = pos moves it to
    position i for good; if none comes before step pos, step pos moves it to j_pos (or
    leaves it there for good when j_pos = pos). Positions only grow, so once pos >= size
    (and no earlier capture) it ends outside the prefix. A few hops settle most tokens."""
    length = n - 1
    k = jnp.arange(length, dtype=jnp.int32)
    z = random_u32(seed, length) % (jnp.uint32(n) - k.astype(jnp.uint32))
    j = k + z.astype(jnp.int32)  # [N, L]

    def hop(carry):
        pos, t, inside, done = carry
        caught = jnp.any(
            (k >= t[:, None]) & (k < jnp.minimum(pos, size)[:, None]) & (j == pos[:, None]),
            axis=1,
        )
        at = jnp.take_along_axis(j, jnp.clip(pos, 0, length - 1)[:, None], axis=1)[:, 0]
        early = pos < size
        stays = caught | (early & (at == pos))
        ends = ~done & (stays | ~early)
        inside = inside | (~done & stays)
        moving = ~done & ~ends
        return (
            jnp.where(moving, at, pos),
            jnp.where(moving, pos + 1, t),
            inside,
            done | ends,
        )

    start = (token.astype(jnp.int32), jnp.zeros_like(token, jnp.int32))
    flags = jnp.zeros(token.shape, bool)
    _, _, inside, _ = jax.lax.while_loop(lambda c: jnp.any(~c[3]), hop, (*start, flags, flags))
    return inside


def coin_table(seed: int, size: int) -> jax.Array:
    """[size] u8: `torch.randint(0, 2, (size,), generator=g)` with `g.manual_seed(seed)`."""
    bits = random_u32(jnp.asarray([seed & 0xFFFFFFFF], jnp.uint32), size)[0]
    return (bits & 1).astype(jnp.uint8)
