"""A row whose logits turn NaN or +inf ends with finish_reason "error"; the others carry on.

The scripted model of `scripted.py` is wrapped so that the row whose prompt starts with
`MARKER` gets a NaN (or +inf) logit at generated index `k` (the prefill's draw is index 0).
Rows are told apart by the cache, which the scripted model fills with the tokens fed.
`ll.sample` gives such a row token 0 and log-probabilities -inf; the decode loop does not
append that token, so the row keeps the k tokens drawn before (finite log-probabilities).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll

from .scripted import _apply, _init_cache, expected

V = 40
MARKER = 39
MAX_TOKENS = 12
SEEDS = [5, 6, 7]
GOOD = [[1, 2, 3], [4], [8, 9]]  # rows 0 and 2 are kept; row 1 is swapped for BAD


def _table():
    table = np.random.default_rng(99).integers(0, MARKER, size=(V, 256))  # never MARKER
    return jnp.asarray(table, jnp.int32)


def _bad_apply(params, tokens, positions, cache):
    """Module-level, with the poison as data: every case shares one compiled program."""
    table, value, k = params
    logits, cache = _apply(table, tokens, positions, cache)
    # The prompt [MARKER, x] has its last prompt token at position 1: index i is drawn from
    # the logits of position 1 + i.
    bad = (cache[:, 0] == MARKER) & (positions[:, -1] == 1 + k)
    poisoned = logits.at[:, 5].set(value)
    return jnp.where(bad[:, None], poisoned, logits), cache


def bad_model(value: float, k: int):
    weights = (_table(), jnp.float32(value), jnp.int32(k))
    return ll.FunctionModel(_bad_apply, weights, _init_cache, V, 512)


TEMPERATURES = [1.0, 0.0, 1.0]  # the row that goes bad is greedy: `expected` gives its tokens


def _params(logprobs=2):
    return ll.SamplingParams.create(
        batch_size=3,
        temperature=TEMPERATURES,
        seed=SEEDS,
        max_tokens=MAX_TOKENS,
        logprobs=logprobs,
    )


CASES = [(float("nan"), 0), (float("nan"), 4), (float("inf"), 3)]


def _check_bad_row(res, r, k):
    assert res.finish_reason[r] == "error"
    assert res.error[r] is not None
    assert res.stop_reason[r] is None
    # Index k was never appended: the row holds the k good tokens drawn before it.
    want = expected(np.asarray(_table()), [MARKER, 1], k)[0]
    assert res.token_ids[r] == want
    assert res.num_tokens[r] == k
    assert all(np.isfinite(res.logprobs[r])) and all(np.isfinite(res.raw_logprobs[r]))
    assert len(res.logprobs[r]) == len(res.raw_logprobs[r]) == len(res.top_logprobs[r]) == k


def _check_good_rows(res, ref, rows):
    for r in rows:
        assert res.token_ids[r] == ref.token_ids[r]
        assert res.finish_reason[r] == ref.finish_reason[r] == "length"
        assert res.logprobs[r] == ref.logprobs[r]
        assert res.raw_logprobs[r] == ref.raw_logprobs[r]
        assert res.top_logprobs[r] == ref.top_logprobs[r]
        assert res.error[r] is None


@pytest.mark.parametrize("value, k", CASES)
def test_generate_ends_the_bad_row_only(value, k):
    model = bad_model(value, k)
    res = ll.generate(model, [GOOD[0], [MARKER, 1], GOOD[2]], _params())
    ref = ll.generate(model, GOOD, _params())
    _check_bad_row(res, 1, k)
    _check_good_rows(res, ref, [0, 2])
    assert ref.num_tokens == [MAX_TOKENS] * 3  # the wrapper leaves unmarked rows alone


@pytest.mark.parametrize("value, k", CASES)
def test_stream_ends_the_bad_row_with_error(value, k):
    model = bad_model(value, k)
    prompts = [GOOD[0], [MARKER, 1], GOOD[2]]
    res = ll.generate(model, prompts, _params())
    rows: dict[int, list[ll.StreamEvent]] = {}
    for ev in ll.stream(model, prompts, _params(), chunk_steps=2):
        rows.setdefault(ev.row, []).append(ev)
    for r in range(3):
        assert sum((e.token_ids for e in rows[r]), []) == res.token_ids[r]
        assert rows[r][-1].finish_reason == res.finish_reason[r]
        assert all(e.finish_reason is None for e in rows[r][:-1])
    assert rows[1][-1].finish_reason == "error"


@pytest.mark.parametrize("value, k", CASES)
def test_generate_many_ends_the_bad_request_only(value, k):
    model = bad_model(value, k)
    knobs = [
        dict(temperature=t, seed=s, max_tokens=MAX_TOKENS, logprobs=2)
        for t, s in zip(TEMPERATURES, SEEDS, strict=True)
    ]
    requests = [(GOOD[0], knobs[0]), ([MARKER, 1], knobs[1]), (GOOD[2], knobs[2])]
    got = ll.generate_many(model, requests * 2, slots=2, chunk_steps=3)
    ref = ll.generate(model, GOOD, _params())
    for i, res in enumerate(got):
        if i % 3 == 1:
            _check_bad_row(res, 0, k)
        else:
            one = ll.GenerationResult(
                **{
                    f: [getattr(ref, f)[i % 3]]
                    for f in (
                        "token_ids",
                        "finish_reason",
                        "stop_reason",
                        "num_tokens",
                        "prompt_token_ids",
                        "logprobs",
                        "raw_logprobs",
                        "top_logprobs",
                        "error",
                    )
                }
            )
            _check_good_rows(res, one, [0])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sample_gives_token_zero_and_minus_inf(value):
    logits = np.random.default_rng(3).normal(size=(3, V)).astype(np.float32)
    logits[1, 7] = value
    params = _params(logprobs=3)
    out = ll.sample(jnp.asarray(logits), params, jnp.zeros(3, jnp.int32))
    assert np.asarray(out.status).tolist() == [ll.STATUS_OK, ll.STATUS_BAD_LOGITS, ll.STATUS_OK]
    assert int(out.tokens[1]) == 0
    assert float(out.logprobs[1]) == float(out.raw_logprobs[1]) == -np.inf
    assert np.all(np.asarray(out.top_logprobs.values[1]) == -np.inf)
    assert np.all(np.asarray(out.top_logprobs.ids[1]) == -1)
    # The other rows equal the same rows sampled next to a finite row.
    logits[1, 7] = 0.0
    clean = ll.sample(jnp.asarray(logits), params, jnp.zeros(3, jnp.int32))
    for name in ("tokens", "logprobs", "raw_logprobs"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, name))[[0, 2]], np.asarray(getattr(clean, name))[[0, 2]]
        )
    assert np.all(np.isfinite(np.asarray(clean.logprobs)))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_score_flags_the_pair_whose_logits_went_bad(value):
    """`ll.score` gives such a position -inf, no alternatives, and says so in the pair's
    `error` (a one-token continuation: the scripted model returns the last column only);
    the other pair is untouched."""
    bad, good = ll.score(bad_model(value, 0), [[MARKER, 7], [1, 2, 3]], [[4], [6]], top_logprobs=2)
    assert bad.raw_logprobs == [-np.inf] and bad.raw_logprob_sum == -np.inf
    assert "NaN or +inf" in bad.error and "position(s) [0]" in bad.error
    assert all(v == -np.inf for v in bad.top_logprobs[0].values())
    assert good.error is None and np.isfinite(good.raw_logprobs[0])


def test_score_of_logits_minus_inf_everywhere_is_minus_inf_not_nan():
    from logitloop.decoding.engine.token_scores import raw_logprobs

    logits = jnp.full((1, 2, 4), -jnp.inf).at[0, 1].set(0.0)  # position 0: every token -inf
    raw, (_, _, bad) = raw_logprobs(logits, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool))
    assert raw[0, 0] == -np.inf and np.isclose(raw[0, 1], -np.log(4.0))
    assert bad.tolist() == [[True, False]]
