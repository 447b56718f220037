"""The XLA path's shortcuts against the plain computation they replace.

- `candidates` (a two-step top_k over blocks of the row) returns exactly `lax.top_k`:
  the same values and the same ids, ties in index order.
- `filter_and_sample` with `temperature=` (unscaled logits, scaled only where read) returns
  the same tokens and thresholds as on the scaled logits, and the same log-probabilities
  up to float32 summation order.
- A batch of greedy rows takes a shortcut (the first argmax, nothing else); each row gets
  exactly what the full path gives a greedy row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.ops.sampling import xla
from logitloop.ops.sampling.noise import row_keys


def _logits(rng, batch, vocab, kind):
    x = rng.standard_normal((batch, vocab)).astype(np.float32) * 3
    if kind == "ties":  # a few values repeated all over the row, across block boundaries
        x = rng.choice(np.float32([5.0, 4.5, 4.5, 1.0, -2.0]), (batch, vocab)).astype(np.float32)
    elif kind == "masked":  # most of the row -inf, one row entirely
        x[rng.random((batch, vocab)) < 0.97] = -np.inf
        x[0] = -np.inf
    elif kind == "constant":
        x[:] = 1.25
    elif kind == "grid":  # ties among the largest values only
        x = np.round(x * 2) / 2
    return jnp.asarray(x)


@pytest.mark.parametrize("vocab", [8200, 20_011, 40_000, 65_537])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "constant", "grid"])
def test_candidates_equal_lax_top_k(vocab, kind):
    rng = np.random.default_rng(vocab + len(kind))
    x = _logits(rng, 3, vocab, kind)
    for c in (256, 64):
        want_v, want_i = jax.lax.top_k(x, c)
        got_v, got_i = jax.jit(xla.candidates, static_argnums=1)(x, c)
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))


@pytest.mark.parametrize("vocab", [3001, 20_011])
def test_unscaled_logits_with_temperature_equal_scaled_logits(vocab):
    rng = np.random.default_rng(vocab)
    batch = 12
    z = np.array(_logits(rng, batch, vocab, "grid"))
    z[1, rng.random(vocab) < 0.5] = -np.inf
    z = jnp.asarray(z)
    temperature = jnp.asarray([0.0, 0.7, 1.0, 1.5, 3.0, 0.3, 1.0, 2.0, 0.9, 1.1, 0.5, 1.7])
    top_k = jnp.asarray([0, 50, 0, 0, 400, 1, 0, 300, 20, 0, 0, 5000], jnp.int32)
    top_p = jnp.asarray([1.0, 0.9, 0.99, 0.999, 0.8, 1.0, 0.5, 0.95, 1.0, 0.3, 1.0, 0.97])
    min_p = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2, 0.0])
    greedy = temperature == 0
    run = jax.jit(xla.filter_and_sample)
    for trial in range(3):
        key = row_keys(jnp.arange(batch, dtype=jnp.uint32) + 31 * trial, jnp.zeros(batch))
        want, want_thr = run(xla.scale_logits(z, temperature), top_k, top_p, min_p, greedy, key)
        got, got_thr = run(z, top_k, top_p, min_p, greedy, key, temperature=temperature)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        for a, b in zip(jax.tree.leaves(got_thr), jax.tree.leaves(want_thr), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # Sums over a whole row may run in another order once fused: float32 rounding.
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), 1e-6)
        np.testing.assert_allclose(np.asarray(got.log_norm), np.asarray(want.log_norm), 1e-6)


def test_tiny_temperature_scales_every_read_alike():
    """T = 1e-30 makes |x| ~ 1e31: the candidates, the whole-vocabulary race and the chosen
    token's logit must be scaled to the same bits, or the log-probability of the argmax
    (which holds all the mass) comes out as a difference of huge numbers instead of 0."""
    rng = np.random.default_rng(5)
    z = jnp.asarray(rng.standard_normal((3, 20_011)).astype(np.float32) * 3)
    temperature = jnp.full((3,), 1e-30, jnp.float32)
    key = row_keys(jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3))
    draw, _ = jax.jit(xla.filter_and_sample)(
        z,
        jnp.zeros(3, jnp.int32),
        jnp.asarray([1.0, 0.9, 0.5]),
        jnp.zeros(3),
        jnp.zeros(3, bool),
        key,
        temperature=temperature,
    )
    np.testing.assert_array_equal(np.asarray(draw.tokens), np.asarray(jnp.argmax(z, axis=1)))
    np.testing.assert_array_equal(np.asarray(draw.logprobs), 0.0)


@pytest.mark.parametrize("vocab", [300, 20_011])
def test_all_greedy_batch_equals_greedy_rows_of_the_full_path(vocab):
    rng = np.random.default_rng(vocab)
    rows = 8
    z = rng.standard_normal((rows + 1, vocab)).astype(np.float32) * 3
    z[1] = -np.inf  # every token masked
    z[2] = 1.25  # constant
    z[3, rng.choice(vocab, 40, replace=False)] = 20.0  # ties at the max
    z[4, 7] = np.inf
    z[5, 11] = np.nan  # NaN and +inf rows: the sampler reports them bad, token 0
    z[5, 12] = 50.0
    z[6] = z[6] * 1e3 + 3e4  # large magnitudes
    z = jnp.asarray(z)
    top_k = jnp.asarray(rng.integers(0, 50, rows + 1), jnp.int32)
    top_p = jnp.asarray(rng.uniform(0.3, 1.0, rows + 1), jnp.float32)
    min_p = jnp.asarray(rng.uniform(0.0, 0.2, rows + 1), jnp.float32)
    key = row_keys(jnp.arange(rows + 1, dtype=jnp.uint32), jnp.zeros(rows + 1))
    run = jax.jit(xla.filter_and_sample)
    greedy = jnp.ones(rows + 1, bool)
    t = jnp.zeros(rows + 1, jnp.float32)
    # The last row sampled instead: the whole batch then takes the full path.
    full = run(z, top_k, top_p, min_p, greedy.at[-1].set(False), key, temperature=t.at[-1].set(1.0))
    fast = run(z, top_k, top_p, min_p, greedy, key, temperature=t)
    # Not the NaN row: which of its tokens wins is undefined (the sampler reports it bad).
    same = np.flatnonzero(~np.isnan(np.asarray(z)[:rows]).any(axis=1))
    pairs = zip(jax.tree.leaves(fast), jax.tree.leaves(full), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a)[same], np.asarray(b)[same])
    tokens = np.asarray(fast[0].tokens)
    np.testing.assert_array_equal(tokens[same], np.argmax(np.asarray(z)[same], axis=1))
