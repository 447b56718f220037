"""The tokens `ll.sample` draws follow the reference distribution (chi-square, binomial).

One row is replicated across a batch with a different seed per copy, so each batch holds
independent draws from one distribution.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import logitloop as ll

from .sampler_cases import Row, batch_inputs, repeat_rows, unambiguous_logits

NUM_DRAWS = 20_000
P_MIN = 1e-3


def _draw(row: Row, logits, num: int, seed: int, chunk: int = NUM_DRAWS):
    """`num` tokens drawn for `row` from seeds seed, seed+1, ... -> [num] int."""
    vocab = logits.shape[0]
    params, positions, hist = batch_inputs([row], vocab)
    tokens = []
    for start in range(0, num, chunk):
        n = min(chunk, num - start)
        rep = repeat_rows(params, positions, hist, n, seed + start + np.arange(n))
        batch = jnp.broadcast_to(logits, (n, vocab))
        tokens.append(np.asarray(ll.sample(batch, rep[0], rep[1], history=rep[2]).tokens))
    return np.concatenate(tokens)


def _pooled(observed, expected, min_expected=5.0):
    """Pool every bin whose expected count is below `min_expected` into one bin."""
    small = expected < min_expected
    obs = list(observed[~small])
    exp = list(expected[~small])
    if small.any() and expected[small].sum() > 0:
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < min_expected:  # still too small: merge into the smallest other bin
            i = int(np.argmin(exp[:-1]))
            obs[i] += obs.pop()
            exp[i] += exp.pop()
    return np.asarray(obs, float), np.asarray(exp, float)


SMALL_VOCAB = 64
SETTINGS = {
    "plain": (SMALL_VOCAB, Row(), {}),
    "temperature_top_k": (SMALL_VOCAB, Row(temperature=0.7, top_k=10), dict(tie_frac=0.2)),
    "top_p": (SMALL_VOCAB, Row(top_p=0.9), {}),
    "min_p": (SMALL_VOCAB, Row(min_p=0.1, temperature=1.3), {}),
    "penalties_and_truncation": (
        SMALL_VOCAB,
        Row(
            temperature=0.8,
            top_k=30,
            top_p=0.95,
            min_p=0.01,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias={3: 2.0, 4: -1.0},
            banned=(5,),
            prompt_tokens=(0, 1, 2, 7),
            generated_tokens=(1, 3, 3, 8, 9, 9, 9),
        ),
        dict(scale=2.0),
    ),
    # A nucleus wider than the sampler's candidate list: hundreds of kept tokens, in a
    # vocabulary that is not a multiple of a power of two.
    "wide_nucleus": (2000, Row(temperature=1.5, top_p=0.99), dict(scale=2.5, neg_inf_frac=0.0)),
    # Candidates from the blocked two-step top_k; top-k beyond them (a threshold search).
    "large_vocabulary": (20_011, Row(temperature=0.9, top_k=300, min_p=0.002), dict(scale=2.0)),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_draws_follow_the_reference_distribution(name):
    vocab, row, logit_kw = SETTINGS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    logits, probs, kept = unambiguous_logits(rng, row, vocab, **logit_kw)
    if name == "wide_nucleus":
        assert kept.sum() > 256, kept.sum()
    chunk = NUM_DRAWS if vocab <= 256 else 2_500
    tokens = _draw(row, logits, NUM_DRAWS, seed=int(rng.integers(0, 2**31)), chunk=chunk)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[~kept].sum() == 0, f"drew {np.flatnonzero(counts * ~kept)} outside the kept set"
    obs, exp = _pooled(counts[kept], NUM_DRAWS * probs[kept])
    assert len(obs) > 1
    p = stats.chisquare(obs, exp).pvalue
    assert p > P_MIN, f"chi-square p = {p:.2e} over {len(obs)} bins"


def test_chi_square_rejects_a_wrong_distribution():
    """The check above can fail: draws under T=1 are rejected against the T=0.8 reference."""
    vocab, row, logit_kw = SETTINGS["plain"]
    rng = np.random.default_rng(7)
    logits, _, _ = unambiguous_logits(rng, row, vocab, **logit_kw)
    tokens = _draw(row, logits, NUM_DRAWS, seed=123)
    probs, kept = Row(temperature=0.8).reference(np.asarray(logits))
    obs, exp = _pooled(np.bincount(tokens, minlength=vocab)[kept], NUM_DRAWS * probs[kept])
    assert stats.chisquare(obs, exp).pvalue < P_MIN


# Far tail. One head token and 2^21 - 1 tail tokens, each holding q = 15/16 * 2^-26 of the
# mass, about 3% together. Why naive noise fails here: Gumbel-max picks argmax(z_i + g_i)
# with g = -log(-log(u)); with u on a 24-bit grid, g <= -log(-log(1 - 2^-24)) ~= 16.6, so a
# tail token beats the head (log-odds z_head - z_tail = log(0.97 / q) ~= 18.0) only when the
# head's own noise falls below 16.6 - 18.0 = -1.4, probability exp(-e^1.4) ~= 1.6%. The tail
# is then reached at ~1.6% of its true rate: ~0.2 of the ~12 tail draws expected below, which
# the binomial test rejects. (The same holds for Exp(1) noise -log(u): its smallest value is
# ~2^-24, so a tail token's race time is at least 2^-24 / q > 4.)
#
# The cost is inherent: tail draws = draws * V * q, so ~12 tail draws take
# draws * V ~= 12 / q ~= 0.8e9 token evaluations, tens of seconds on a CPU at best.
TAIL_VOCAB = 2**21
TAIL_SHARE = 15 / 16 * 2.0**-26
TAIL_DRAWS = 400


@pytest.mark.slow
def test_far_tail_tokens_are_drawn_at_their_rate():
    m = TAIL_VOCAB - 1
    tail_logit = np.log(TAIL_SHARE / (1 - m * TAIL_SHARE))
    logits = np.full(TAIL_VOCAB, tail_logit, np.float32)
    logits[0] = 0.0
    x = logits.astype(np.float64)
    tail_rate = m * np.exp(x[1]) / (1 + m * np.exp(x[1]))
    assert np.exp(x[1]) / (1 + m * np.exp(x[1])) < 2.0**-26
    tokens = _draw(Row(), jnp.asarray(logits), TAIL_DRAWS, seed=2024, chunk=4)
    hits = int((tokens != 0).sum())
    p = stats.binomtest(hits, TAIL_DRAWS, tail_rate).pvalue
    assert p > P_MIN, f"{hits} tail draws of {TAIL_DRAWS}, expected {TAIL_DRAWS * tail_rate:.1f}"
