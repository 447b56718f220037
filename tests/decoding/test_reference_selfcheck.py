"""The float64 reference against tiny hand-computed examples, so that it can be trusted."""

import math

import numpy as np
import pytest

from .reference import (
    AmbiguousBoundary,
    adjusted_logits,
    reference_distribution,
    reference_raw_logprobs,
    reference_top_logprobs,
)

LN = np.log


def kept_ids(kept):
    return set(np.flatnonzero(kept).tolist())


def test_plain_softmax():
    probs, kept = reference_distribution([0.0, LN(2), LN(4)])
    np.testing.assert_allclose(probs, [1 / 7, 2 / 7, 4 / 7], rtol=1e-12)
    assert kept.all()


def test_temperature_divides_the_logits():
    probs, _ = reference_distribution([0.0, LN(2)], temperature=0.5)
    np.testing.assert_allclose(probs, [1 / 5, 4 / 5], rtol=1e-7)


@pytest.mark.parametrize(
    "top_k, expected",
    [
        (1, {1}),
        (2, {1, 3}),
        (3, {1, 2, 3, 4}),
        (4, {1, 2, 3, 4}),
        (5, {0, 1, 2, 3, 4}),
        (0, {0, 1, 2, 3, 4}),
        (-3, {0, 1, 2, 3, 4}),
        (9, {0, 1, 2, 3, 4}),
    ],
)
def test_top_k_keeps_ties_with_the_kth(top_k, expected):
    _, kept = reference_distribution([1.0, 3.0, 2.0, 3.0, 2.0], top_k=top_k)
    assert kept_ids(kept) == expected


def test_top_k_counts_only_finite_tokens():
    _, kept = reference_distribution([1.0, -np.inf, 2.0, -np.inf], top_k=3)
    assert kept_ids(kept) == {0, 2}


@pytest.mark.parametrize(
    "top_p, expected", [(0.45, {0}), (0.55, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_shortest_prefix_reaching_p(top_p, expected):
    probs, kept = reference_distribution(LN([0.5, 0.3, 0.15, 0.05]), top_p=top_p)
    assert kept_ids(kept) == expected
    full = np.array([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(probs, np.where(kept, full, 0) / full[kept].sum(), rtol=1e-12)


def test_top_p_keeps_every_token_tied_with_the_last():
    _, kept = reference_distribution(LN([0.4, 0.2, 0.2, 0.2]), top_p=0.5)
    assert kept_ids(kept) == {0, 1, 2, 3}


def test_top_p_works_on_the_top_k_renormalised_distribution():
    logits = LN([0.4, 0.3, 0.2, 0.1])
    # Over all four tokens the cumulative mass is .4, .7, .9: p = .75 needs three tokens.
    assert kept_ids(reference_distribution(logits, top_p=0.75)[1]) == {0, 1, 2}
    # Over the top-3 renormalised (.444, .333, .222) it reaches .778 after two.
    assert kept_ids(reference_distribution(logits, top_k=3, top_p=0.75)[1]) == {0, 1}


@pytest.mark.parametrize(
    "min_p, expected", [(0.5, {0, 1}), (0.7, {0}), (0.35, {0, 1, 2}), (0.0, {0, 1, 2})]
)
def test_min_p_keeps_tokens_above_a_fraction_of_the_max(min_p, expected):
    _, kept = reference_distribution(LN([0.5, 0.3, 0.2]), min_p=min_p)
    assert kept_ids(kept) == expected


def test_min_p_one_keeps_the_tied_maxima():
    _, kept = reference_distribution([2.0, 1.0, 2.0], min_p=1.0, temperature=0.7)
    assert kept_ids(kept) == {0, 2}


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(top_k=1, temperature=3.0)])
def test_greedy_is_one_hot_at_the_lowest_tied_argmax(settings):
    probs, kept = reference_distribution([1.0, 3.0, -np.inf, 3.0], **settings)
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])
    assert kept_ids(kept) == {1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_once_per_token():
    x = adjusted_logits(
        [2.0, -2.0, 1.0, 0.0],
        repetition_penalty=2.0,
        prompt_tokens=[0, 3],
        generated_tokens=[1, 1, 0],
    )
    np.testing.assert_array_equal(x, [1.0, -4.0, 1.0, 0.0])


def test_presence_and_frequency_count_generated_tokens_only():
    x = adjusted_logits(
        np.zeros(4),
        presence_penalty=0.25,
        frequency_penalty=0.5,
        prompt_tokens=[3, 3],
        generated_tokens=[1, 1, 2],
    )
    np.testing.assert_allclose(x, [0.0, -1.25, -0.75, 0.0])


def test_repetition_penalty_acts_before_presence():
    x = adjusted_logits(
        [3.0, 0.0], repetition_penalty=1.5, presence_penalty=1.0, generated_tokens=[0]
    )
    np.testing.assert_allclose(x, [1.0, 0.0], rtol=1e-7)


def test_masks_and_bias():
    x = adjusted_logits(
        [0.5, 0.5, 0.5, 0.5], allowed=[1, 2], banned=[2], logit_bias={0: 5.0, 1: 1.0, 2: 9.0}
    )
    np.testing.assert_array_equal(x, [-np.inf, 1.5, -np.inf, -np.inf])


@pytest.mark.parametrize("position, suppressed", [(0, True), (1, True), (2, False), (5, False)])
def test_min_tokens_suppresses_stop_ids_before_position(position, suppressed):
    x = adjusted_logits([1.0, 2.0, 3.0], min_tokens=2, stop_token_ids=[2, 0], position=position)
    expected = [-np.inf, 2.0, -np.inf] if suppressed else [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(x, expected)


def test_every_token_masked_gives_an_empty_distribution():
    probs, kept = reference_distribution([1.0, 2.0], allowed=[1], banned=[1])
    assert not kept.any() and not probs.any()


def test_raw_logprobs_are_log_softmax():
    np.testing.assert_allclose(
        reference_raw_logprobs([0.0, LN(3), -np.inf]), [LN(0.25), LN(0.75), -np.inf], rtol=1e-12
    )


def test_top_logprobs_sorted_with_ties_in_id_order():
    ids, values = reference_top_logprobs([1.0, 3.0, 2.0, 3.0], 3)
    np.testing.assert_array_equal(ids, [1, 3, 2])
    norm = math.log(math.exp(1) + 2 * math.exp(3) + math.exp(2))
    np.testing.assert_allclose(values, [3 - norm, 3 - norm, 2 - norm])


@pytest.mark.parametrize(
    "logits, settings",
    [
        ([1.0, 2.0, 2.00001, 0.0], dict(top_k=2)),  # top-k boundary near-tie
        ([1.0, 2.0, 2.00001, 0.0], dict(temperature=0.0)),  # greedy near-tie
        (LN([0.5, 0.3, 0.2]), dict(top_p=0.80001)),  # mass reaches p by 1e-5
        (LN([0.5, 0.25, 0.25]) + [0, 0, 1e-5], dict(top_p=0.6)),  # near-tie at the last kept
        (LN([0.5, 0.3, 0.2]), dict(min_p=0.6000001)),  # prob 0.3 vs threshold 0.30000005
    ],
)
def test_margin_refuses_decisions_that_hinge_on_rounding(logits, settings):
    reference_distribution(logits, **settings)  # fine without a margin
    with pytest.raises(AmbiguousBoundary):
        reference_distribution(logits, margin=1e-4, **settings)


def test_margin_accepts_exact_ties():
    reference_distribution([1.0, 2.0, 2.0, 0.0], top_k=2, margin=1e-4)
    reference_distribution([1.0, 2.0, 2.0, 0.0], temperature=0.0, margin=1e-4)
