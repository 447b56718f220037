"""`DRY` against a float64 transcription of text-generation-webui's DRYLogitsProcessor."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.processors import DRY

from .cases import apply_jit, assert_bits_equal, make_history, random_rows
from .reference import dry_row

V, C = 16, 128
# Per row: multiplier (0 = off), base, allowed_length, penalty_range (0 = all).
MULTIPLIER = [0.8, 1.0, 0.0, 1.0, 0.5, 2.0, 1.0, 0.3, 0.0, 1.5, 1.0, 0.7, 1.0]
BASE = [1.75, 2.0, 1.75, 1.0, 1.5, 1.75, 3.0, 1.2, 2.0, 1.75, 1.1, 1.75, 1.75]
ALLOWED = [2, 1, 2, 0, 1, 3, 2, 1, 2, 4, 2, 1, 2]
RANGE = [0, 0, 0, 10, 0, 5, 0, 20, 0, 0, 0, 7, 0]
B = len(MULTIPLIER)


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    rows, num_prompt = random_rows(rng, B, V, C)
    period = rng.choice(V, size=3, replace=False).tolist()
    rows[10] = (period * 50)[:120]  # a loop longer than the match cap (50)
    breakers = []
    for r in range(B):
        k = int(rng.integers(0, 3)) if r % 3 else 0
        breakers.append(rng.choice(V, size=k, replace=False).tolist())
    breakers[10] = [t for t in range(V) if t not in period][:1]  # never reached: m is capped
    breakers[12] = rows[12][-1:]  # the last token is a breaker: nothing is penalised
    logits = rng.normal(size=(B, V)).astype(np.float32)
    return rows, num_prompt, breakers, logits


def _dry(breakers):
    return DRY.create(
        B,
        multiplier=MULTIPLIER,
        base=BASE,
        allowed_length=ALLOWED,
        penalty_range=RANGE,
        sequence_breakers=breakers,
        vocab_size=V,
    )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_reference_per_row(seed):
    rows, num_prompt, breakers, logits = _inputs(seed)
    out = np.asarray(
        apply_jit(_dry(breakers), jnp.asarray(logits), make_history(rows, num_prompt, C))
    )
    penalised = 0
    for r in range(B):
        mult, base = float(np.float32(MULTIPLIER[r])), float(np.float32(BASE[r]))  # as stored
        expected = dry_row(rows[r], logits[r], mult, base, ALLOWED[r], RANGE[r], breakers[r])
        what = f"row {r} (tokens {rows[r]}, breakers {breakers[r]})"
        same = expected == logits[r]
        assert_bits_equal(out[r][same], logits[r][same], what)  # untouched bit for bit
        np.testing.assert_allclose(out[r], expected, rtol=1e-6, atol=1e-6, err_msg=what)
        penalised += bool((~same).any())
    assert penalised >= 4, "the inputs should penalise several rows"
    for r in (2, 8, 12):  # off rows and the row ending in a breaker
        assert_bits_equal(out[r], logits[r], f"row {r}")


def test_worked_example():
    # [7, 1, 2, 9, 1, 2]: 9 would extend the repeat [1, 2] (m = 2); with allowed_length 1
    # its penalty is multiplier * base ** (2 - 1). A breaker at 1 cuts the match to m = 1;
    # a breaker at 9 is never penalised as the continuation. With allowed_length 0, 2
    # (which follows the last token 2 nowhere) is not penalised: a repeat has m >= 1.
    hist = make_history([[7, 1, 2, 9, 1, 2]] * 4, [3, 3, 3, 3], 8)
    logits = jnp.zeros((4, 10), jnp.float32)
    proc = DRY.create(
        4,
        multiplier=0.5,
        base=3.0,
        allowed_length=[1, 1, 1, 0],
        sequence_breakers=[None, [1], [9], None],
    )
    out = np.asarray(apply_jit(proc, logits, hist))
    expected = np.zeros((4, 10), np.float32)
    expected[0, 9] = -0.5 * 3.0
    expected[1, 9] = -0.5
    expected[3, 9] = -0.5 * 3.0**2
    np.testing.assert_array_equal(out, expected)


def test_new_values_compile_nothing(compile_counter):
    rows, num_prompt, breakers, logits = _inputs(5)
    hist = make_history(rows, num_prompt, C)
    apply_jit(_dry(breakers), jnp.asarray(logits), hist)
    other = DRY.create(
        B,
        multiplier=MULTIPLIER[::-1],
        base=2.5,
        allowed_length=ALLOWED[::-1],
        penalty_range=3,
        sequence_breakers=[[1, 2]] * B,
    )
    with compile_counter as c:
        apply_jit(other, jnp.asarray(logits), hist)
    assert c.count == 0
