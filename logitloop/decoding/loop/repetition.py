"""The repetition guard, on device: does a row's generated text end in a loop?

A row with `repetition_guard=(max_period, min_repeats)` (`SamplingParams.create`; stored as
`guard_period`, `guard_repeats`) ends once its last `p * min_repeats` generated tokens
repeat one period of `p <= max_period` tokens, i.e. once token i equals token i - p at each
of its last `p * (min_repeats - 1)` positions.

The loop keeps, per row and per period p = 1..MAX_GUARD_PERIOD, the run of trailing
positions whose token equals the one p back (`DecodeState.repeat_runs`, [B, P]); each new
token extends or resets each run (`advance`, reading P tokens back), and the row loops once
some run reaches its need (`looping_period`). A step costs O(P) per row whatever the
settings, a new setting never compiles, and a batch without a guarded row skips it all
(`guard`, a `lax.cond`).

Worked example, `max_period = 2, min_repeats = 3`, generated `7 1 2 1 2 1 2`: the run of
period 2 is 0 0 0 1 2 3 4 after each token; it reaches 2 * (3 - 1) = 4 at the 7th token,
whose last 6 are `(1 2)(1 2)(1 2)`, so the row ends there (finish reason "repetition"), its
7 tokens kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.decoding.sampling.checks import MAX_GUARD_PERIOD

PERIODS = jnp.arange(1, MAX_GUARD_PERIOD + 1)  # [P] the periods each row's runs follow


def empty_runs(batch: int) -> jax.Array:
    """[B, P] i32: rows with nothing generated."""
    return jnp.zeros((batch, MAX_GUARD_PERIOD), jnp.int32)


def advance(
    runs: jax.Array,  # [B, P] i32
    tokens: jax.Array,  # [B, N] i32, generated tokens, the new one included
    num_tokens: jax.Array,  # [B] i32, tokens generated, the new one included
    write: jax.Array,  # [B] bool, the rows that took a new token
) -> jax.Array:
    """[B, P] the runs after each writing row's new token (column `num_tokens - 1`)."""
    new_col = num_tokens - 1  # [B]
    back = new_col[:, None] - PERIODS[None, :]  # [B, P] the column p back
    earlier = jnp.take_along_axis(tokens, jnp.clip(back, 0, tokens.shape[1] - 1), axis=1)
    token = jnp.take_along_axis(tokens, jnp.maximum(new_col, 0)[:, None], axis=1)  # [B, 1]
    same = (earlier == token) & (back >= 0)
    return jnp.where(write[:, None], jnp.where(same, runs + 1, 0), runs)


def looping_period(
    runs: jax.Array,  # [B, P] i32
    max_period: jax.Array,  # [B] i32, 0 = no guard
    min_repeats: jax.Array,  # [B] i32
) -> jax.Array:
    """[B] i32: the shortest period p <= max_period whose run reaches p * (min_repeats - 1),
    or 0 (no loop, or no guard)."""
    need = PERIODS[None, :] * (min_repeats[:, None] - 1)  # [B, P]
    hit = (PERIODS[None, :] <= max_period[:, None]) & (runs >= need) & (need > 0)
    return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, 0).astype(jnp.int32)


def guard(
    runs: jax.Array,
    tokens: jax.Array,
    num_tokens: jax.Array,
    write: jax.Array,
    max_period: jax.Array,
    min_repeats: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`advance` and `looping_period` ((runs [B, P], period [B])), run only when some row
    has a guard (else the runs as they are and no period)."""

    def check(runs, tokens, num_tokens, write, max_period, min_repeats):
        runs = advance(runs, tokens, num_tokens, write)
        return runs, looping_period(runs, max_period, min_repeats)

    def skip(runs, *_):
        return runs, jnp.zeros(runs.shape[:1], jnp.int32)

    operands = (runs, tokens, num_tokens, write, max_period, min_repeats)
    return jax.lax.cond(jnp.any(max_period > 0), check, skip, *operands)


@jax.jit
def periods_after_each(tokens: jax.Array, max_period: jax.Array, min_repeats: jax.Array):
    """[T, B] the looping period (or 0) after each of the T tokens of rows [B, T], as the
    loop sees them one token at a time (`explain`, the tests)."""
    batch, length = tokens.shape
    write = jnp.ones((batch,), bool)

    def step(runs, n):
        runs = advance(runs, tokens, jnp.full((batch,), n), write)
        return runs, looping_period(runs, max_period, min_repeats)

    return jax.lax.scan(step, empty_runs(batch), jnp.arange(1, length + 1))[1]
