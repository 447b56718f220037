"""The repetition guard, on device: does a row's generated text end in a loop?

A row with `repetition_guard=(max_period, min_repeats)` (`SamplingParams.create`; stored as
`guard_period`, `guard_repeats`) ends once its last `p * min_repeats` generated tokens
repeat one period of `p <= max_period` tokens, i.e. once token i equals token i - p at each
of its last `p * (min_repeats - 1)` positions. The loop checks it after every token
(`decode_loop.record`) over the last `GUARD_WINDOW` generated tokens, a static window, so a
new setting never compiles; a batch without a guarded row skips the check (`lax.cond`).

Worked example, `max_period = 2, min_repeats = 3`, generated `7 1 2 1 2 1 2`: after the 7th
token the last 6 are `(1 2)(1 2)(1 2)`, token i equals token i - 2 at the last 4 positions,
so the row ends there (finish reason "repetition"), its 7 tokens kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitloop.decoding.sampling.checks import GUARD_WINDOW, MAX_GUARD_PERIOD


def repetition_hits(
    tokens: jax.Array,  # [B, N] i32, generated tokens, -1 past num_tokens
    num_tokens: jax.Array,  # [B] i32, tokens generated, the newest included
    max_period: jax.Array,  # [B] i32, 0 = the row has no guard
    min_repeats: jax.Array,  # [B] i32
) -> jax.Array:
    """[B] i32: the shortest period p <= max_period that the row's last p * min_repeats
    tokens repeat, or 0 where none does (or the row has no guard)."""
    batch, buf = tokens.shape
    width = min(GUARD_WINDOW, buf)  # the last `width` tokens, newest at the right
    periods = jnp.arange(1, min(MAX_GUARD_PERIOD, max(width - 1, 1)) + 1)  # [P]
    at = num_tokens[:, None] - width + jnp.arange(width)[None, :]  # [B, W] buffer columns
    recent = jnp.take_along_axis(tokens, jnp.clip(at, 0, buf - 1), axis=1)  # [B, W]
    back = jnp.arange(width)[None, :] - periods[:, None]  # [P, W] the column p back
    earlier = recent[:, jnp.clip(back, 0, width - 1)]  # [B, P, W]
    # Token i equals token i - p, both generated (columns before the first are not).
    same = (recent[:, None, :] == earlier) & (at[:, None, :] - periods[None, :, None] >= 0)
    last_miss = jnp.max(jnp.where(same, -1, jnp.arange(width)), axis=2)  # [B, P]
    run = width - 1 - last_miss  # [B, P] trailing positions equal to the one p back
    need = periods[None, :] * (min_repeats[:, None] - 1)  # [B, P]
    hit = (periods[None, :] <= max_period[:, None]) & (run >= need) & (need > 0)
    return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, 0).astype(jnp.int32)


def guarded_hits(
    tokens: jax.Array, num_tokens: jax.Array, max_period: jax.Array, min_repeats: jax.Array
) -> jax.Array:
    """`repetition_hits`, computed only when some row has a guard (zeros otherwise)."""
    return jax.lax.cond(
        jnp.any(max_period > 0),
        repetition_hits,
        lambda *_: jnp.zeros(num_tokens.shape, jnp.int32),
        tokens,
        num_tokens,
        max_period,
        min_repeats,
    )
