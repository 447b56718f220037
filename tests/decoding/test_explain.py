"""`explain_next_token`: every step's distribution comes from the sampler's own code path,
the final one is what `ll.sample` draws from, and the logits are what `generate` sees."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import logitloop as ll
from logitloop.cli import explain_view as view
from logitloop.decoding.engine import explain as ex
from logitloop.decoding.engine.generate import initial_state
from logitloop.decoding.engine.plan import plan

from .test_sampler_distribution import _pooled

PROMPT = "Once upon a time"
NUM_DRAWS = 6000
CHUNK = 2048  # one batch shape for every draw in this file: ll.sample compiles once
P_MIN = 1e-3


@pytest.fixture(scope="module")
def model():
    """The shipped model, unless LOGITLOOP_CLI_TEST_MODEL names another checkpoint folder."""
    path = os.environ.get("LOGITLOOP_CLI_TEST_MODEL")
    if path and not Path(path).is_dir():
        pytest.skip(f"LOGITLOOP_CLI_TEST_MODEL={path} is not a folder")
    return ll.load_pretrained(path or None)


def _explain(model, **knobs) -> ex.Explanation:
    return ex.explain_next_token(model, PROMPT, ll.SamplingParams.create(**knobs))


@pytest.fixture(scope="module")
def plain(model) -> ex.Explanation:
    return _explain(model)


@pytest.fixture(scope="module")
def knobs(plain) -> dict:
    """Every truncation knob on, the model's argmax banned and a bias on its 31st token."""
    raw_order = np.argsort(-plain.logits, kind="stable")
    return dict(
        temperature=0.8,
        top_k=20,
        top_p=0.8,
        min_p=0.3,
        banned_token_ids=[int(raw_order[0])],
        logit_bias={int(raw_order[30]): 3.0},
        seed=11,
    )


@pytest.fixture(scope="module")
def tuned(model, knobs) -> ex.Explanation:
    return _explain(model, **knobs)


def _support(p: np.ndarray) -> set[int]:
    return set(np.flatnonzero(p > 0).tolist())


def test_final_is_the_sampling_distribution(tuned):
    logits = jnp.asarray(tuned.logits)[None, :]
    ref = ll.sampling_distribution(logits, tuned.params, jnp.zeros((1,), jnp.int32), tuned.history)
    np.testing.assert_allclose(tuned.final, np.asarray(ref)[0], rtol=0, atol=1e-7)
    assert tuned.status == ll.STATUS_OK
    assert tuned.final[tuned.sampled_token] > 0
    assert np.isclose(np.log(tuned.final[tuned.sampled_token]), tuned.sampled_logprob, atol=1e-5)


def test_every_step_follows_the_documented_semantics(plain, tuned, knobs):
    t = tuned
    for _, probs in t.stages():
        assert np.isclose(probs.sum(), 1.0, atol=1e-5)
    assert np.allclose(t.raw, plain.raw)  # knobs never touch the model's own distribution

    # masks and bias: the banned argmax is gone, the biased token gains exactly e^3
    banned = knobs["banned_token_ids"][0]
    (biased,) = knobs["logit_bias"]
    ref = int(next(i for i in t.token_ids if i != biased))
    assert t.raw[banned] > 0 and t.adjusted[banned] == 0 and t.cut[banned] == ex.CUT_MASK
    gain = (t.adjusted[biased] / t.adjusted[ref]) / (t.raw[biased] / t.raw[ref])
    assert np.isclose(gain, np.exp(3.0), rtol=1e-4)

    # temperature: log-probability gaps divided by T
    kept_adj = np.flatnonzero(t.adjusted > 1e-30)
    gaps_adj = np.log(t.adjusted[kept_adj]) - np.log(t.adjusted[ref])
    gaps_temp = np.log(t.tempered[kept_adj]) - np.log(t.tempered[ref])
    np.testing.assert_allclose(gaps_temp, gaps_adj / knobs["temperature"], atol=2e-4)

    # top-k: the k largest (ties kept), renormalised
    k = knobs["top_k"]
    after_k = _support(t.after_top_k)
    kth = np.sort(t.tempered)[::-1][k - 1]
    assert after_k == _support(t.tempered >= kth) and len(after_k) >= k
    idx = sorted(after_k)
    np.testing.assert_allclose(
        t.after_top_k[idx], t.tempered[idx] / t.tempered[idx].sum(), rtol=1e-5
    )

    # top-p over the top-k survivors: the smallest most-likely prefix reaching p
    after_p = _support(t.after_top_p)
    assert after_p <= after_k
    mass = t.after_top_k[sorted(after_p)].sum()
    smallest = min(t.after_top_k[sorted(after_p)])
    assert mass >= knobs["top_p"] - 1e-5 and mass - smallest < knobs["top_p"] + 1e-5

    # min-p: prob >= min_p * max prob among the top-p survivors
    final = _support(t.final)
    expected = {i for i in after_p if t.tempered[i] >= knobs["min_p"] * t.tempered.max() * 0.9999}
    assert final == expected

    # which step cut each token: the first step after which its probability is zero
    for i in range(t.vocab_size):
        if t.adjusted[i] == 0 and t.raw[i] > 0:
            want = ex.CUT_MASK
        elif t.after_top_k[i] == 0:
            want = ex.CUT_TOP_K
        elif t.after_top_p[i] == 0:
            want = ex.CUT_TOP_P
        elif t.final[i] == 0:
            want = ex.CUT_MIN_P
        else:
            want = ex.KEPT
        assert t.cut[i] == want, (i, t.cut[i], want)
    # the kept set is the top of token_ids
    n_kept = len(final)
    assert set(t.token_ids[:n_kept].tolist()) == final


def test_greedy_rows(model, plain):
    argmax = int(np.argmax(plain.logits))
    zero = _explain(model, temperature=0.0)
    for probs in (zero.tempered, zero.after_top_k, zero.after_top_p, zero.final):
        assert probs[argmax] == 1.0 and probs.sum() == 1.0
    assert zero.greedy and zero.sampled_token == argmax
    others = np.arange(zero.vocab_size) != argmax
    assert np.all(zero.cut[others] == ex.CUT_GREEDY) and zero.cut[argmax] == ex.KEPT

    one = _explain(model, temperature=0.5, top_k=1)
    assert one.greedy and one.final[argmax] == 1.0
    assert 0 < one.tempered[argmax] < 1.0  # temperature still shown, top-k does the cut
    assert np.all(one.cut[others] == ex.CUT_TOP_K)


def test_all_masked_row(model):
    expl = _explain(model, allowed_token_ids=[5], banned_token_ids=[5])
    assert expl.status == ll.STATUS_ALL_MASKED
    assert expl.final.sum() == 0 and np.all(expl.cut == ex.CUT_MASK)
    assert "every token is masked" in view.format_table(expl, 5)


def test_logits_are_what_generate_sees(model, knobs):
    """generate's prefill (which samples the first token) draws the same tokens as explain's
    ll.sample draws, with the same raw top-20 log-probabilities and final log-probability."""
    seeds = [1000, 1001, 1002, 1003]
    row = dict(knobs, seed=seeds[0], logprobs=20)
    expl = ex.explain_next_token(model, PROMPT, ll.SamplingParams.create(1, **row))
    drawn = ex.draw_next_tokens(expl, len(seeds), first_seed=seeds[0], chunk=CHUNK)
    assert drawn[0] == expl.sampled_token
    for seed, token in zip(seeds, drawn, strict=True):
        params = ll.SamplingParams.create(1, **dict(row, seed=seed))
        job = plan(model)
        ids, params = job.rows([PROMPT], params)
        state = initial_state(job.program, job.tables(params), ids)
        assert int(state.tokens[0, 0]) == token
        assert np.isclose(float(state.logprobs[0, 0]), np.log(expl.final[token]), atol=1e-5)
    top_ids = np.asarray(state.top_ids[0, 0])
    np.testing.assert_allclose(
        np.asarray(state.top_values[0, 0]), np.log(expl.raw[top_ids]), atol=1e-5
    )


def test_draws_follow_the_final_distribution(model, plain):
    raw_order = np.argsort(-plain.logits, kind="stable")
    expl = _explain(
        model,
        temperature=1.1,
        top_k=200,
        top_p=0.97,
        min_p=0.002,
        repetition_penalty=1.3,
        logit_bias={int(raw_order[50]): 2.0},
    )
    kept = expl.final > 0
    assert kept.sum() > 10  # a spread-out distribution, so the test has power
    draws = ex.draw_next_tokens(expl, NUM_DRAWS, first_seed=20240601, chunk=CHUNK)
    assert draws.shape == (NUM_DRAWS,) and np.all(kept[draws])
    observed = np.bincount(draws, minlength=expl.vocab_size)[kept]
    final = expl.final[kept].astype(np.float64)
    expected = final / final.sum() * NUM_DRAWS
    obs, exp = _pooled(observed, expected)
    assert len(obs) >= 5
    p = stats.chisquare(obs, exp).pvalue
    assert p > P_MIN, p


def test_table_lists_candidates_and_cuts(tuned, knobs):
    table = view.format_table(tuned, top=6)
    lines = table.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    for title in ("raw", "masks/bias/pen", "temperature", "top-k", "top-p", "min-p=final"):
        assert title in header
    banned = knobs["banned_token_ids"][0]
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert len(rows) == 7  # the 6 most likely after the ban, plus the banned argmax
    fates = {int(r.split()[1]): r.rsplit("  ", 1)[-1] for r in rows}
    assert fates[banned] == "cut: masks"
    for tok, fate in fates.items():
        want = "kept" if tuned.cut[tok] == ex.KEPT else f"cut: {ex.STEP_NAMES[tuned.cut[tok]]}"
        assert fate == want
    assert tuned.token_text(tuned.token_ids[0]) in rows[0]
    assert f"seed {knobs['seed']}" in lines[-1]


def test_figure_has_three_panels(tuned, tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")  # the `plot` extra

    draws = ex.draw_next_tokens(tuned, 300, chunk=CHUNK)
    fig = view.explanation_figure(tuned, draws, top=6, temperatures=np.linspace(0.1, 2.0, 12))
    assert len(fig.axes) == 3
    out = tmp_path / "explain.png"
    fig.savefig(out, dpi=50)
    image = matplotlib_image.imread(out)
    assert image.shape[:2] == (round(5.6 * 50), 19 * 50)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="one row"):
        ex.explain_next_token(model, PROMPT, ll.SamplingParams.create(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ex.explain_next_token(model, [10**7], ll.SamplingParams.create(1))
    expl = _explain(model)
    with pytest.raises(ValueError, match="num_draws"):
        ex.draw_next_tokens(expl, 0)
    with pytest.raises(ValueError, match="temperatures"):
        ex.temperature_sweep(expl, [0.0, 1.0])
