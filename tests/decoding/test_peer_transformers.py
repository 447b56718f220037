"""`ll.sampling_distribution` agrees with the `transformers` logits processors it mirrors.

The peer runs in float64 torch on the same float32 logits; its warpers apply in the order
`transformers` uses: repetition penalty, temperature, top-k, top-p, min-p.

Top-p differs by definition in two places, both kept out of these inputs:
- `TopPLogitsWarper` sorts ascending and drops tokens whose cumulative probability is
  <= 1 - p. Without ties that keeps the same set as "the shortest descending prefix whose
  mass reaches p"; with a tie group straddling the boundary, `transformers` keeps only the
  part that its sort order puts last, while logitloop keeps every tied token. The logits
  here have no exact ties.
- When the cumulative mass equals p up to rounding, the two cumulative sums (ascending vs
  descending, float64 vs float32) may fall on different sides. Inputs whose mass lies within
  `MASS_MARGIN` of p are redrawn (`unambiguous_logits`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")

import logitloop as ll  # noqa: E402

from .sampler_cases import Row, batch_inputs, unambiguous_logits  # noqa: E402

V = 128
TINY = 1e-30


def _history(rng):
    return dict(
        prompt_tokens=tuple(rng.integers(0, V, 6).tolist()),
        generated_tokens=tuple(rng.integers(0, V, 4).tolist()),
    )


def _rows(rng):
    return [
        Row(temperature=0.5),
        Row(temperature=1.3),
        Row(top_k=1),
        Row(top_k=5),
        Row(top_k=40),
        Row(top_p=0.3),
        Row(top_p=0.9),
        Row(min_p=0.05),
        Row(min_p=0.3),
        Row(repetition_penalty=1.3, **_history(rng)),
        Row(repetition_penalty=0.7, **_history(rng)),
        Row(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.2,
            **_history(rng),
        ),
        Row(temperature=1.7, top_p=0.95, min_p=0.01),
        Row(temperature=0.6, top_k=10, top_p=0.5),
    ]


def transformers_distribution(logits, row: Row) -> np.ndarray:
    """One row through the `transformers` processors (float64), softmaxed -> [V]."""
    f32 = lambda v: float(np.float32(v))  # the values SamplingParams stores
    scores = torch.tensor(np.asarray(logits, np.float64))[None]
    ids = torch.tensor([list(row.prompt_tokens) + list(row.generated_tokens)], dtype=torch.long)
    processors = []
    if row.repetition_penalty != 1.0:
        processors.append(
            logits_process.RepetitionPenaltyLogitsProcessor(f32(row.repetition_penalty))
        )
    processors.append(logits_process.TemperatureLogitsWarper(f32(row.temperature)))
    if row.top_k > 0:
        processors.append(logits_process.TopKLogitsWarper(row.top_k))
    if row.top_p < 1.0:
        processors.append(logits_process.TopPLogitsWarper(f32(row.top_p)))
    if row.min_p > 0.0:
        processors.append(logits_process.MinPLogitsWarper(f32(row.min_p)))
    for proc in processors:
        scores = proc(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


@pytest.fixture(scope="module")
def compared():
    rng = np.random.default_rng(2718)
    rows = _rows(rng)
    n_gen = max(len(r.generated_tokens) for r in rows)
    rows = [
        r
        if r.generated_tokens
        else dataclasses.replace(r, generated_tokens=tuple(rng.integers(0, V, n_gen).tolist()))
        for r in rows
    ]
    logits = [unambiguous_logits(rng, r, V, tie_frac=0.0, tie_max=False)[0] for r in rows]
    params, positions, hist = batch_inputs(rows, V)
    x = np.stack([np.asarray(v) for v in logits])
    ours = np.asarray(ll.sampling_distribution(x, params, positions, history=hist))
    peer = np.stack([transformers_distribution(v, r) for v, r in zip(x, rows, strict=True)])
    return rows, x, ours, peer


def test_kept_sets_agree_with_transformers(compared):
    rows, _, ours, peer = compared
    for r, row in enumerate(rows):
        sure = (peer[r] > TINY) | (ours[r] > 0)
        np.testing.assert_array_equal(ours[r][sure] > 0, peer[r][sure] > 0, err_msg=f"{row}")


def test_probabilities_agree_with_transformers(compared):
    rows, _, ours, peer = compared
    for r, row in enumerate(rows):
        np.testing.assert_allclose(ours[r], peer[r], rtol=0, atol=1e-5, err_msg=f"{row}")


def test_the_peer_comparison_sees_truncation(compared):
    """Guard against a vacuous comparison: the truncating rows really drop tokens."""
    rows, x, ours, _ = compared
    for r, row in enumerate(rows):
        if row.top_k > 0 or row.top_p < 1 or row.min_p > 0:
            assert ((ours[r] == 0) & np.isfinite(x[r])).any(), f"{row}"
