"""`TypicalP` against a float64 loop reference and `transformers.TypicalLogitsWarper`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.processors import TypicalP

from .cases import apply_jit, assert_bits_equal, make_history
from .reference import typical_row

V = 64
MASS = [0.2, 0.5, 1.0, 0.9, 0.95, 0.05, 0.7, 1.0, 0.99, 0.3, 0.6, 0.5]  # 1 = off
MARGIN = 1e-4  # inputs this close to a float32/float64 disagreement are redrawn
HIST = make_history([[]] * len(MASS), [0] * len(MASS), 1)  # TypicalP reads no history


def _logits(seed: int) -> np.ndarray:
    """Rows at several scales (as after different temperatures), some tokens masked to
    -inf, the last row entirely -inf; rows too close to a boundary are redrawn."""
    rng = np.random.default_rng(seed)
    out = np.empty((len(MASS), V), np.float32)
    for r, mass in enumerate(MASS):
        while True:
            row = (rng.normal(size=V) * rng.choice([0.3, 1.0, 3.0, 8.0])).astype(np.float32)
            row[rng.random(V) < 0.2 * (r % 2)] = -np.inf
            if typical_row(row, mass)[1] > MARGIN:
                break
        out[r] = row
    out[-1] = -np.inf
    return out


def _check_row(actual: np.ndarray, logits: np.ndarray, expected: np.ndarray, what: str):
    kept = np.isfinite(expected)
    assert np.array_equal(np.isfinite(actual), kept), f"{what}: kept set differs"
    assert_bits_equal(actual[kept], logits[kept], what)  # survivors untouched
    assert np.isneginf(actual[~kept]).all(), what


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_per_row(seed):
    logits = _logits(seed)
    out = np.asarray(apply_jit(TypicalP.create(len(MASS), MASS), jnp.asarray(logits), HIST))
    dropped = 0
    for r, mass in enumerate(MASS):
        expected, _ = typical_row(logits[r], mass)
        _check_row(out[r], logits[r], expected, f"row {r} (mass {mass})")
        dropped += int((np.isfinite(logits[r]) & ~np.isfinite(out[r])).sum())
        if mass == 1.0:
            assert_bits_equal(out[r], logits[r], f"off row {r}")
    assert dropped > 0


@pytest.mark.parametrize("seed", [3, 4])
def test_matches_transformers(seed):
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = _logits(seed)
    out = np.asarray(apply_jit(TypicalP.create(len(MASS), MASS), jnp.asarray(logits), HIST))
    for r, mass in enumerate(MASS[:-1]):  # the all -inf row: transformers gives NaN scores
        if mass == 1.0:  # transformers accepts only mass < 1
            continue
        warper = lp.TypicalLogitsWarper(mass=float(np.float32(mass)), min_tokens_to_keep=1)
        peer = warper(torch.zeros((1, 0), dtype=torch.long), torch.tensor(logits[r : r + 1]))
        _check_row(out[r], logits[r], peer[0].numpy(), f"row {r} (mass {mass})")


def test_runs_after_the_filters_as_in_transformers():
    """Temperature, top-k, top-p and min-p, then typical: the distribution a row draws
    from is transformers' warpers in its order (typical after min-p), softmaxed."""
    import logitloop as ll

    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    b, logits = 3, _logits(6)[:3]
    knobs = dict(temperature=[0.7, 1.3, 0.9], top_k=[40, 0, 0], top_p=[1.0, 0.8, 1.0],
                 min_p=[0.0, 0.0, 0.05])  # fmt: skip
    got = np.asarray(ll.sampling_distribution(
        jnp.asarray(logits), ll.SamplingParams.create(b, **knobs), jnp.zeros((b,), jnp.int32),
        processors=[TypicalP.create(b, 0.6)]))  # fmt: skip
    for r in range(b):
        chain = [lp.TemperatureLogitsWarper(knobs["temperature"][r])]
        chain += [lp.TopKLogitsWarper(knobs["top_k"][r])] if knobs["top_k"][r] else []
        chain += [lp.TopPLogitsWarper(knobs["top_p"][r])] if knobs["top_p"][r] < 1 else []
        chain += [lp.MinPLogitsWarper(knobs["min_p"][r])] if knobs["min_p"][r] else []
        x = torch.tensor(logits[r : r + 1])
        for step in [*chain, lp.TypicalLogitsWarper(mass=float(np.float32(0.6)))]:
            x = step(torch.zeros((1, 0), dtype=torch.long), x)
        want = torch.softmax(x, dim=-1)[0].numpy()
        assert ((got[r] > 0) == (want > 0)).all(), r
        np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-6, err_msg=f"row {r}")


def test_closed_forms():
    # p = [0.4, 0.3, 0.3]: H = 1.089 nats; the 0.3 tokens (surprisal 1.204) are more typical
    # than the 0.4 token (0.916), and reach mass 0.5 together: the most likely token goes.
    # A uniform row: every score is 0, all tied at the boundary, so every token stays.
    logits = jnp.asarray(np.log([[0.4, 0.3, 0.3], [0.2, 0.2, 0.2]]), jnp.float32)
    out = np.asarray(apply_jit(TypicalP.create(2, 0.5), logits, make_history([[]] * 2, [0, 0], 1)))
    assert np.isneginf(out).tolist() == [[True, False, False], [False, False, False]]


def test_mass_reached_exactly():
    # p = [0.5, 0.25, 0.125, 0.125] (powers of two, exact in float32): H = 1.213 nats, the
    # 0.25 token is the most typical and alone reaches mass 0.25 exactly, so it alone stays,
    # as in transformers (cumulative < mass counts the tokens before the boundary).
    logits = jnp.asarray(np.log([[0.5, 0.25, 0.125, 0.125]]), jnp.float32)
    out = np.asarray(apply_jit(TypicalP.create(1, 0.25), logits, make_history([[]], [0], 1)))
    assert np.isfinite(out).tolist() == [[False, True, False, False]]


def test_scores_one_ulp_apart_split_at_the_boundary():
    # Tokens 0 and 1 differ by one float32 ulp of their logit, so their scores differ by
    # about two ulps; `mass` is put where token 0 reaches it and token 1 would exceed it.
    logits = np.asarray(
        [2.0, np.nextafter(np.float32(2), np.float32(3)), 0, 0.5, -1, 1, -0.5, 0.25], np.float32
    )
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    score = np.abs(-logp - -(np.exp(logp) * logp).sum())
    before = np.exp(logp)[score < min(score[0], score[1])].sum()
    mass = before + np.exp(logp[0]) / 2
    assert score[1] > score[0]
    expected, margin = typical_row(logits, float(np.float32(mass)))
    assert margin > 0 and np.isfinite(expected[0]) and np.isneginf(expected[1])
    out = np.asarray(
        apply_jit(TypicalP.create(1, mass), jnp.asarray(logits[None]), make_history([[]], [0], 1))
    )
    _check_row(out[0], logits, expected, "one-ulp split")


def test_after_filters_is_not_a_leaf(compile_counter):
    proc = TypicalP.create(len(MASS), MASS)
    assert TypicalP.after_filters is True
    assert len(jax.tree_util.tree_leaves(proc)) == 1
    logits = jnp.asarray(_logits(5))
    apply_jit(proc, logits, HIST)
    with compile_counter as c:
        apply_jit(TypicalP.create(len(MASS), 0.4), logits, HIST)
    assert c.count == 0
