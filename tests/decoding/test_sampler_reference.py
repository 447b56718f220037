"""`ll.sample` and `ll.sampling_distribution` against the float64 reference, row by row.

Each case is one batch whose rows carry different settings: every transform alone, then
combinations, then large magnitudes and half-precision inputs. Logits are drawn fresh from a
generator seeded per case, with exact ties and -inf entries, and redrawn while the
reference's kept set hinges on a float32 rounding (`reference.py`, `margin`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll

from .reference import reference_raw_logprobs, reference_top_logprobs
from .sampler_cases import Row, batch_inputs, repeat_rows, unambiguous_logits

DRAWS_PER_ROW = 32  # extra draws per row from other seeds
TINY = 1e-30  # reference probabilities below this may underflow to 0 in float32


def _history(rng, vocab, n_generated=6):
    prompt = tuple(rng.integers(0, vocab, rng.integers(0, 9)).tolist())
    # Draw generated tokens from a few ids so that some repeat (frequency counts > 1).
    pool = rng.integers(0, vocab, 4)
    generated = tuple(rng.choice(pool, n_generated).tolist())
    return dict(prompt_tokens=prompt, generated_tokens=generated)


def _ids(rng, vocab, n):
    return tuple(rng.choice(vocab, n, replace=False).tolist())


def _random_row(rng, vocab, *, penalties=True, masks=True) -> Row:
    """Every knob drawn at random (one combination per row)."""
    kw = dict(
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])),
        top_k=int(rng.choice([0, 1, 3, 10, 40, vocab])),
        top_p=float(rng.choice([1.0, 0.95, 0.8, 0.5, 0.2])),
        min_p=float(rng.choice([0.0, 0.0, 0.02, 0.2])),
    )
    if penalties:
        kw.update(
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
            presence_penalty=float(rng.choice([0.0, 0.5, -0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.4, -0.3])),
            **_history(rng, vocab),
        )
    else:
        kw.update(generated_tokens=(1, 2, 3))  # present but unpenalised
    if masks:
        kw.update(
            logit_bias={int(t): float(rng.uniform(-10, 10)) for t in _ids(rng, vocab, 3)},
            banned=_ids(rng, vocab, int(rng.integers(0, 4))),
            allowed=None if rng.random() < 0.6 else _ids(rng, vocab, int(rng.integers(1, 40))),
            min_tokens=int(rng.integers(0, 3)),
            stop_token_ids=_ids(rng, vocab, 2),
            position=int(rng.integers(0, 4)),
        )
    return Row(**kw)


def _alone(name, values, **common):
    return lambda rng: [Row(**{name: v}, **common) for v in values]


V = 256  # one vocabulary (and 8 rows per case) so that the cases share compiled samplers
LARGE_V = 20_011
# name -> (vocab, dtype, logits kwargs, rows(rng) -> 8 Rows)
CASES = {
    "temperature": (
        V,
        jnp.float32,
        {},
        _alone("temperature", [0.25, 0.5, 0.7, 1.0, 1.3, 2.0, 5.0, 0.9]),
    ),
    "greedy": (
        V,
        jnp.float32,
        dict(tie_frac=0.3),
        lambda rng: [
            Row(temperature=0.0),
            Row(temperature=0.0, top_p=0.3, min_p=0.5),
            Row(temperature=0.0, top_k=7),
            Row(top_k=1),
            Row(top_k=1, temperature=0.4),
            Row(top_k=1, temperature=2.0, top_p=0.2),
            Row(temperature=0.0, logit_bias={3: 50.0}),
            Row(top_k=1, banned=(0, 1, 2, 3)),
        ],
    ),
    "top_k": (
        V,
        jnp.float32,
        dict(tie_frac=0.3),
        _alone("top_k", [-1, 0, 2, 17, 100, V - 1, V, V + 44], temperature=0.8),
    ),
    "top_k_on_a_grid": (
        V,
        jnp.float32,
        dict(grid=0.25, scale=1.5),
        _alone("top_k", [2, 3, 5, 8, 13, 70, 130, 200]),
    ),
    "top_p": (V, jnp.float32, {}, _alone("top_p", [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0])),
    "top_p_on_a_grid": (
        V,
        jnp.float32,
        dict(grid=0.5, scale=1.5),
        _alone("top_p", [0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97]),
    ),
    "min_p": (
        V,
        jnp.float32,
        dict(tie_frac=0.3),
        _alone("min_p", [0.0, 0.001, 0.01, 0.05, 0.1, 0.3, 0.7, 1.0], temperature=1.2),
    ),
    "repetition_penalty": (
        V,
        jnp.float32,
        dict(offset=0.5),
        lambda rng: [
            Row(repetition_penalty=v, **_history(rng, V))
            for v in [0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0, 1.1]
        ],
    ),
    "presence_penalty": (
        V,
        jnp.float32,
        {},
        lambda rng: [
            Row(presence_penalty=v, **_history(rng, V)) for v in [-2, -0.5, 0, 0.3, 0.7, 1, 2, 1.5]
        ],
    ),
    "frequency_penalty": (
        V,
        jnp.float32,
        {},
        lambda rng: [
            Row(frequency_penalty=v, **_history(rng, V)) for v in [-2, -0.5, 0, 0.3, 0.7, 1, 2, 1.5]
        ],
    ),
    "logit_bias": (
        V,
        jnp.float32,
        {},
        lambda rng: [
            Row(logit_bias={int(t): float(rng.uniform(-100, 100)) for t in _ids(rng, V, n)})
            for n in [0, 1, 2, 3, 4, 4, 7, 12]
        ],
    ),
    "banned": (
        V,
        jnp.float32,
        {},
        lambda rng: (
            [Row(banned=_ids(rng, V, n)) for n in [0, 1, 3, 4, 8, 40, 120]]
            + [Row(banned=(5, 6), logit_bias={5: 100.0, 7: 3.0})]
        ),
    ),
    "allowed": (
        V,
        jnp.float32,
        {},
        lambda rng: [
            Row(allowed=None),
            Row(allowed=_ids(rng, V, 1)),
            Row(allowed=_ids(rng, V, 3)),
            Row(allowed=_ids(rng, V, 30), temperature=0.0),
            Row(allowed=(1, 2, 3, 4), banned=(2,), logit_bias={1: 100.0, 9: 100.0}),
            Row(allowed=_ids(rng, V, 60), top_k=5),
            Row(allowed=None, banned=(0, 1)),
            Row(allowed=_ids(rng, V, 120), top_p=0.5),
        ],
    ),
    "min_tokens": (
        V,
        jnp.float32,
        dict(tie_frac=0.0),
        lambda rng: (
            [
                Row(min_tokens=3, stop_token_ids=_ids(rng, V, 2), position=p, temperature=t)
                for p, t in [(0, 1.0), (1, 1.0), (2, 0.0), (2, 1.0), (3, 1.0), (4, 0.0), (7, 1.0)]
            ]
            + [Row(min_tokens=2, stop_token_ids=(0, 1, 2, 3), position=0, logit_bias={0: 100.0})]
        ),
    ),
    "temperature_top_k_top_p": (
        V,
        jnp.float32,
        {},
        lambda rng: [_random_row(rng, V, penalties=False, masks=False) for _ in range(8)],
    ),
    "top_p_min_p": (
        V,
        jnp.float32,
        {},
        lambda rng: [
            Row(top_p=p, min_p=m, temperature=t)
            for p, m, t in [
                (0.9, 0.1, 1.0),
                (0.5, 0.05, 1.5),
                (0.99, 0.3, 0.7),
                (0.2, 0.01, 3.0),
                (0.95, 0.02, 2.0),
                (0.7, 0.5, 1.0),
                (0.8, 0.001, 0.5),
                (0.6, 0.2, 1.2),
            ]
        ],
    ),
    "everything": (V, jnp.float32, {}, lambda rng: [_random_row(rng, V) for _ in range(8)]),
    # Kept sets wider than the sampler's candidate list, and top-k beyond it; a vocabulary
    # that is not a multiple of a power of two.
    "wide_nucleus": (
        1000,
        jnp.float32,
        dict(scale=1.0),
        lambda rng: [
            Row(top_p=0.99, temperature=1.5),
            Row(top_k=300),
            Row(top_k=100, top_p=0.95),
            Row(top_k=700, top_p=0.7, temperature=1.3),
            Row(top_p=0.9, min_p=0.05),
            Row(top_p=0.5),
            Row(top_k=65),
            Row(top_k=64, temperature=0.5),
        ],
    ),
    # Magnitudes near 1e4 (float32 spacing 2^-10) with only float32-exact knobs: temperature
    # a power of two, penalty 2, no bias, so both sides see the same scaled logits.
    "large_magnitude": (
        V,
        jnp.float32,
        dict(offset=1e4, scale=3.0),
        lambda rng: [
            Row(),
            Row(temperature=0.5),
            Row(temperature=2.0, top_k=10),
            Row(temperature=0.0),
            Row(top_p=0.8),
            Row(min_p=0.1, temperature=0.5),
            Row(banned=(0, 1, 2)),
            Row(repetition_penalty=2.0, **_history(rng, V)),
        ],
    ),
    "large_negative_magnitude": (
        V,
        jnp.float32,
        dict(offset=-1e4, scale=3.0),
        lambda rng: [
            Row(),
            Row(temperature=0.5, top_p=0.7),
            Row(top_k=5),
            Row(top_k=1),
            Row(min_p=0.2),
            Row(temperature=2.0, top_p=0.9, top_k=20),
            Row(temperature=0.25),
            Row(repetition_penalty=2.0, **_history(rng, V)),
        ],
    ),
    "spread_1e4": (
        V,
        jnp.float32,
        dict(scale=4e3),
        lambda rng: [
            Row(),
            Row(top_k=3, temperature=2.0),
            Row(top_p=0.5),
            Row(temperature=0.0),
            Row(banned=(0, 1, 2, 3), min_p=0.5),
            Row(temperature=1024.0),
            Row(temperature=4096.0, top_p=0.9),
            Row(temperature=2048.0, top_k=10),
        ],
    ),
    # Large enough that the candidates come from the two-step blocked top_k (not a multiple
    # of its block size), with every knob, kept sets wider than the candidates and ties.
    "large_vocabulary": (
        LARGE_V,
        jnp.float32,
        dict(tie_frac=0.05),
        lambda rng: (
            [_random_row(rng, LARGE_V) for _ in range(4)]
            + [
                Row(min_p=0.2, temperature=3.0),
                Row(top_k=400, temperature=0.7),
                Row(temperature=0.0),
                Row(top_k=200, top_p=0.9, min_p=0.01, **_history(rng, LARGE_V)),
            ]
        ),
    ),
    "bfloat16": (V, jnp.bfloat16, {}, lambda rng: [_random_row(rng, V) for _ in range(8)]),
    "float16": (V, jnp.float16, {}, lambda rng: [_random_row(rng, V) for _ in range(8)]),
}


@dataclasses.dataclass
class CaseResult:
    rows: list[Row]
    logits: np.ndarray  # [B, V] as given to the sampler (float32 upcast of its dtype)
    ref_probs: np.ndarray  # [B, V] f64
    ref_kept: np.ndarray  # [B, V] bool
    probs: np.ndarray  # [B, V] f32, ll.sampling_distribution
    out: ll.SampleOutput  # one ll.sample call on the batch
    draws: np.ndarray  # [B, DRAWS_PER_ROW] tokens from other seeds


@functools.cache
def run_case(name: str) -> CaseResult:
    vocab, dtype, logit_kw, make_rows = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rows = make_rows(rng)  # first use of rng: _has_greedy_rows sees the same rows
    assert len(rows) == 8
    # Rows without history still need as many generated tokens as the others (History
    # appends one per row per step); their penalties are neutral, so any tokens do.
    n_gen = max(len(r.generated_tokens) for r in rows)
    rows = [
        r
        if r.generated_tokens
        else dataclasses.replace(r, generated_tokens=tuple(rng.integers(0, vocab, n_gen).tolist()))
        for r in rows
    ]
    rows = [
        dataclasses.replace(r, seed=int(rng.integers(0, 2**32)), logprobs=n)
        for r, n in zip(rows, [0, 20, 1, 5, 13, 3, 19, 7], strict=True)
    ]
    drawn = [unambiguous_logits(rng, r, vocab, dtype, **logit_kw) for r in rows]
    logits = jnp.stack([x for x, _, _ in drawn])
    params, positions, hist = batch_inputs(rows, vocab)
    probs = ll.sampling_distribution(logits, params, positions, history=hist)
    out = ll.sample(logits, params, positions, history=hist)
    seeds = rng.integers(0, 2**32, len(rows) * DRAWS_PER_ROW)
    rep = repeat_rows(params, positions, hist, DRAWS_PER_ROW, seeds)
    draws = ll.sample(jnp.repeat(logits, DRAWS_PER_ROW, axis=0), rep[0], rep[1], history=rep[2])
    return CaseResult(
        rows=rows,
        logits=np.asarray(logits.astype(jnp.float32)),
        ref_probs=np.stack([p for _, p, _ in drawn]),
        ref_kept=np.stack([k for _, _, k in drawn]),
        probs=np.asarray(probs),
        out=out,
        draws=np.asarray(draws.tokens).reshape(len(rows), DRAWS_PER_ROW),
    )


case_names = pytest.mark.parametrize("name", list(CASES))


@case_names
def test_kept_set_matches_reference(name):
    res = run_case(name)
    for r, row in enumerate(res.rows):
        kept = res.probs[r] > 0
        assert not (kept & ~res.ref_kept[r]).any(), (
            f"row {r} {row}: kept outside the reference: {np.flatnonzero(kept & ~res.ref_kept[r])}"
        )
        must = res.ref_kept[r] & (res.ref_probs[r] > TINY)
        assert kept[must].all(), (
            f"row {r} {row}: reference keeps {np.flatnonzero(must & ~kept)} but the sampler drops"
        )


LOG_PROB_TOL = 2e-5  # measured: at most 5.6e-6 (logit_bias, biases up to 100 in float32)


@case_names
def test_probabilities_match_reference(name):
    # Compared as log-probabilities, so the error allowed is relative: an absolute 1e-5 on
    # the probabilities would let a tail token's be off by orders of magnitude.
    res = run_case(name)
    for r, row in enumerate(res.rows):
        np.testing.assert_array_equal(
            res.probs[r][res.ref_probs[r] == 0], 0, err_msg=f"row {r} {row}"
        )
        both = (res.probs[r] > 0) & (res.ref_probs[r] > TINY)  # the kept-set test covers > 0
        np.testing.assert_allclose(
            np.log(res.probs[r][both].astype(np.float64)),
            np.log(res.ref_probs[r][both]),
            rtol=0,
            atol=LOG_PROB_TOL,
            err_msg=f"row {r} {row}",
        )


@case_names
def test_status_is_ok_for_sampleable_rows(name):
    np.testing.assert_array_equal(np.asarray(run_case(name).out.status), ll.STATUS_OK)


@case_names
def test_drawn_tokens_lie_in_the_kept_set(name):
    res = run_case(name)
    tokens = np.concatenate([np.asarray(res.out.tokens)[:, None], res.draws], axis=1)
    for r, row in enumerate(res.rows):
        outside = [int(t) for t in tokens[r] if not res.ref_kept[r, t]]
        assert not outside, f"row {r} {row}: drew {outside} outside the reference kept set"


def _has_greedy_rows(name):
    return any(r.greedy for r in CASES[name][3](np.random.default_rng(zlib.crc32(name.encode()))))


@pytest.mark.parametrize("name", [n for n in CASES if _has_greedy_rows(n)])
def test_greedy_rows_return_the_reference_argmax(name):
    res = run_case(name)
    greedy = [r for r, row in enumerate(res.rows) if row.greedy]
    assert greedy, "the case has no greedy row"
    for r in greedy:
        expected = int(np.argmax(res.ref_probs[r]))
        assert int(res.out.tokens[r]) == expected, f"row {r} {res.rows[r]}"
        assert set(res.draws[r].tolist()) == {expected}, f"row {r} {res.rows[r]}"


@case_names
def test_logprobs_are_the_log_of_the_reference_probability(name):
    res = run_case(name)
    tokens = np.asarray(res.out.tokens)
    ref_p = res.ref_probs[np.arange(len(tokens)), tokens]
    sure = ref_p > 1e-6
    np.testing.assert_allclose(
        np.asarray(res.out.logprobs)[sure], np.log(ref_p[sure]), rtol=0, atol=1e-5
    )


@case_names
def test_raw_logprobs_match_float64_log_softmax(name):
    res = run_case(name)
    tokens = np.asarray(res.out.tokens)
    ref = [reference_raw_logprobs(res.logits[r])[t] for r, t in enumerate(tokens)]
    np.testing.assert_allclose(np.asarray(res.out.raw_logprobs), ref, rtol=1e-6, atol=1e-5)


@case_names
def test_top_logprobs_match_the_reference_top_n(name):
    res = run_case(name)
    ids = np.asarray(res.out.top_logprobs.ids)
    values = np.asarray(res.out.top_logprobs.values)
    width = max(row.logprobs for row in res.rows)  # the largest n asked for
    assert ids.shape == values.shape == (len(res.rows), width)
    for r, row in enumerate(res.rows):
        n = row.logprobs
        raw = reference_raw_logprobs(res.logits[r])
        _, ref_values = reference_top_logprobs(res.logits[r], n)
        np.testing.assert_allclose(
            values[r, :n], ref_values, rtol=1e-6, atol=1e-5, err_msg=f"row {r}"
        )
        # Ids may come in any order within an exact tie, but each must carry its own value.
        assert len(set(ids[r, :n].tolist())) == n, f"row {r}: repeated ids {ids[r, :n]}"
        np.testing.assert_allclose(values[r, :n], raw[ids[r, :n]], rtol=1e-6, atol=1e-5)
        np.testing.assert_array_equal(ids[r, n:], -1)
        np.testing.assert_array_equal(values[r, n:], -np.inf)


def test_vocabulary_smaller_than_the_top_logprobs_width():
    vocab = 5  # fewer tokens than the 20 top-logprob slots
    rng = np.random.default_rng(55)
    rows = [
        Row(),
        Row(top_k=2),
        Row(top_p=0.5),
        Row(temperature=0.0),
        Row(min_p=0.3),
        Row(allowed=(1, 3), logprobs=5),
        Row(banned=(0,), logprobs=2),
        Row(logprobs=3),
    ]
    drawn = [unambiguous_logits(rng, r, vocab, neg_inf_frac=0.0) for r in rows]
    logits = jnp.stack([x for x, _, _ in drawn])
    params, positions, hist = batch_inputs(rows, vocab)
    probs = np.asarray(ll.sampling_distribution(logits, params, positions, history=hist))
    out = ll.sample(logits, params, positions, history=hist)
    np.testing.assert_allclose(probs, np.stack([p for _, p, _ in drawn]), rtol=0, atol=1e-5)
    for r, (row, (x, _, kept)) in enumerate(zip(rows, drawn, strict=True)):
        assert kept[int(out.tokens[r])], f"row {r} {row}"
        ids = np.asarray(out.top_logprobs.ids[r])
        ref_ids, _ = reference_top_logprobs(np.asarray(x), min(row.logprobs, vocab))
        assert set(ids[: len(ref_ids)].tolist()) == set(ref_ids.tolist()), f"row {r}"
        np.testing.assert_array_equal(ids[len(ref_ids) :], -1)
