"""`layers.attend` against a float64 NumPy reference, on the cache layout the models use.

A decode step over a long cache reads only a prefix of it (`layers.PREFIX_FRACTIONS`);
the cases put the last visible slot in each prefix, at its edges, and beyond every
prefix, with grouped-query heads, sliding windows and a padded query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.models import layers


def reference_attention(q, k, v, mask, scale):
    """float64: softmax over the visible slots only; a query that sees nothing returns 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((b, t, h, d))
    for r in range(b):
        for c in range(t):
            seen = np.flatnonzero(mask[r, c])
            if not len(seen):
                continue
            for j in range(h):
                kk, vv = k[r, j // group, seen], v[r, j // group, seen]
                s = kk @ q[r, c, j] * scale
                p = np.exp(s - s.max())
                out[r, c, j] = (p / p.sum()) @ vv
    return out


def _case(rng, batch, slots, heads, kv_heads, positions, window=None):
    d = 16
    q = rng.standard_normal((batch, positions.shape[1], heads, d)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, slots, d)).astype(np.float32) * 2
    v = rng.standard_normal((batch, kv_heads, slots, d)).astype(np.float32)
    mask = np.asarray(layers.attention_mask(jnp.asarray(positions), slots, window))
    got = jax.jit(layers.attend, static_argnums=4)(q, k, v, mask, d**-0.5)
    return np.asarray(got), reference_attention(q, k, v, mask, d**-0.5), mask


@pytest.mark.parametrize("slots", [512, 1000, 2048])
def test_decode_step_reads_a_prefix_that_holds_every_visible_slot(slots):
    rng = np.random.default_rng(slots)
    edges = sorted({-(-slots // f) for f in layers.PREFIX_FRACTIONS} | {slots})
    # The furthest position in each case: at a prefix's last slot, one past it, tiny, last.
    furthest = [0, 3] + [e - 1 for e in edges] + [e for e in edges[:-1]]
    for top in furthest:
        positions = np.asarray([[top], [top // 2], [0], [-1]], np.int32)  # a padded query
        got, want, mask = _case(rng, 4, slots, heads=4, kv_heads=2, positions=positions)
        seen = mask.any(axis=2)[:, 0]
        np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5, err_msg=top)
        assert np.isfinite(got).all()


def test_decode_step_with_a_sliding_window():
    rng = np.random.default_rng(7)
    positions = np.asarray([[700], [300], [40]], np.int32)
    got, want, _ = _case(rng, 3, 1024, heads=2, kv_heads=1, positions=positions, window=64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_attends_every_slot():
    rng = np.random.default_rng(8)
    positions = np.asarray([[-1, -1, 0, 1, 2], [596, 597, 598, 599, 600]], np.int32)
    got, want, mask = _case(rng, 2, 640, heads=2, kv_heads=2, positions=positions)
    seen = mask.any(axis=2)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-5)


def test_every_prefix_gives_the_full_product():
    """The prefix is an optimisation only: on the same inputs, each branch's result equals
    attention over all S slots up to float32 summation order."""
    rng = np.random.default_rng(9)
    slots = 1024
    positions = np.asarray([[100], [900]], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, slots, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, slots, 16)), jnp.float32)
    for rows in (np.asarray([0]), np.asarray([1]), np.asarray([0, 1])):
        m = layers.attention_mask(jnp.asarray(positions[rows]), slots, None)
        full = layers._attend(q[rows], k[rows], v[rows], m, 0.25)
        got = layers.attend(q[rows], k[rows], v[rows], m, 0.25)
        np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=2e-6, atol=2e-6)
