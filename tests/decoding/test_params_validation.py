"""Bad input: invalid knobs fail on the host with a message that says what and where; rows
that cannot be sampled get a defined status, a valid token and no NaN."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll

B, V = 3, 50
NAN = math.nan


def _row1(bad, good):
    """A per-row list whose row 1 holds the bad value."""
    return [good, bad, good]


# (argument, value, substrings the message must contain: the argument, the row, the range)
INVALID = [
    ("temperature", _row1(-0.5, 1.0), ["temperature[1]", "[0, 3.40282e+38]"]),
    ("temperature", _row1(NAN, 1.0), ["temperature[1]", "[0, 3.40282e+38]"]),
    (
        "temperature",
        _row1(1e-45, 1.0),
        ["temperature[1]", "0 (greedy) or [1.17549e-38, 3.40282e+38]"],
    ),
    ("top_p", _row1(0.0, 1.0), ["top_p[1]", "(0, 1]"]),
    ("top_p", _row1(1.5, 1.0), ["top_p[1]", "(0, 1]"]),
    ("top_p", _row1(NAN, 1.0), ["top_p[1]", "(0, 1]"]),
    ("min_p", _row1(-0.1, 0.0), ["min_p[1]", "[0, 1]"]),
    ("min_p", _row1(1.01, 0.0), ["min_p[1]", "[0, 1]"]),
    ("min_p", _row1(NAN, 0.0), ["min_p[1]", "[0, 1]"]),
    ("repetition_penalty", _row1(0.0, 1.0), ["repetition_penalty[1]", "(0, 3.40282e+38]"]),
    ("repetition_penalty", _row1(-1.2, 1.0), ["repetition_penalty[1]", "(0, 3.40282e+38]"]),
    ("presence_penalty", _row1(2.5, 0.0), ["presence_penalty[1]", "[-2, 2]"]),
    ("presence_penalty", _row1(-2.01, 0.0), ["presence_penalty[1]", "[-2, 2]"]),
    ("frequency_penalty", _row1(3.0, 0.0), ["frequency_penalty[1]", "[-2, 2]"]),
    ("frequency_penalty", _row1(-2.5, 0.0), ["frequency_penalty[1]", "[-2, 2]"]),
    ("logit_bias", _row1({V: 1.0}, {}), ["logit_bias[1]", f"[0, {V - 1}]", str(V)]),
    ("logit_bias", _row1({-1: 1.0}, {}), ["logit_bias[1]", f"[0, {V - 1}]"]),
    ("banned_token_ids", _row1([3, V + 7], []), ["banned_token_ids[1]", f"[0, {V - 1}]"]),
    ("banned_token_ids", _row1([-2], []), ["banned_token_ids[1]", f"[0, {V - 1}]"]),
    ("allowed_token_ids", _row1([0, V], None), ["allowed_token_ids[1]", f"[0, {V - 1}]"]),
    ("stop_token_ids", _row1([V], []), ["stop_token_ids[1]", f"[0, {V - 1}]"]),
    ("logprobs", _row1(21, 0), ["logprobs[1]", "[0, 20]"]),
    ("logprobs", _row1(-1, 0), ["logprobs[1]", "[0, 20]"]),
]

F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

# Values that float32 cannot hold: overflow to inf, or round to a denormal or 0. Each names
# the argument, the row and the float32 range; integer ranges print as exact integers.
NOT_FLOAT32 = [
    (
        "repetition_penalty",
        _row1(1e-45, 1.0),
        ["repetition_penalty[1]", "(0, 3.40282e+38]", "1.17549e-38"],
    ),
    ("repetition_penalty", _row1(1e300, 1.0), ["repetition_penalty[1]", "(0, 3.40282e+38]"]),
    ("repetition_penalty", _row1(math.inf, 1.0), ["repetition_penalty[1]", "(0, 3.40282e+38]"]),
    ("temperature", _row1(1e39, 1.0), ["temperature[1]", "[0, 3.40282e+38]"]),
    ("temperature", _row1(math.inf, 1.0), ["temperature[1]", "[0, 3.40282e+38]"]),
    ("top_p", _row1(1e-46, 1.0), ["top_p[1]", "(0, 1]", "1.17549e-38"]),
    ("top_p", _row1(1e-40, 1.0), ["top_p[1]", "(0, 1]", "denormal"]),
    ("min_p", _row1(1e-45, 0.0), ["min_p[1]", "[0, 1]", "1.17549e-38"]),
    ("presence_penalty", _row1(-1e-40, 0.0), ["presence_penalty[1]", "[-2, 2]", "1.17549e-38"]),
    ("frequency_penalty", _row1(1e-39, 0.0), ["frequency_penalty[1]", "[-2, 2]"]),
    (
        "logit_bias",
        _row1({3: 1e-45}, {}),
        ["logit_bias[1] token 3: bias", "[-100, 100]", "1.17549e-38"],
    ),
    ("seed", _row1(2**32, 0), ["seed[1]", "[0, 4294967295]"]),
    ("max_tokens", _row1(2**31, 4), ["max_tokens[1]", "[1, 2147483647]"]),
    ("top_k", _row1(2**31, 0), ["top_k[1]", "[-2147483647, 2147483647]"]),
]


@pytest.mark.parametrize(
    "arg, value, expected", NOT_FLOAT32, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(NOT_FLOAT32)]
)
def test_values_float32_cannot_hold_are_rejected(arg, value, expected):
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=B, vocab_size=V, **{arg: value})
    message = str(err.value)
    for text in expected:
        assert text in message, f"{text!r} missing from: {message}"
    assert "e+09" not in message, message


# The extremes that are accepted, one setting per row (8 rows), and the float32 limit values
# stored exactly as given.
EXTREMES = dict(
    temperature=[F32_TINY, F32_MAX, 1.0, 1.0, 1.0, 0.0, 1.0, 2e-38],
    repetition_penalty=[1.0, 1.0, F32_TINY, F32_MAX, 1.0, F32_TINY, 1.0, F32_TINY],
    top_p=[1.0, 1.0, 1.0, 1.0, F32_TINY, 1.0, 1.0, 0.5],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, F32_TINY, 1.0],
    presence_penalty=[0.0, 2.0, 0.0, -2.0, 0.0, 0.0, 2.0, 0.0],
    logit_bias=[{}, {}, {}, {}, {}, {}, {0: 100.0, 1: -100.0}, {2: F32_TINY}],
)


def test_extreme_accepted_values_are_stored_exactly():
    params = ll.SamplingParams.create(batch_size=8, **EXTREMES)
    for name in ("temperature", "repetition_penalty", "top_p", "min_p"):
        stored = np.asarray(getattr(params, name), np.float64)
        assert np.all(np.isfinite(stored)), (name, stored)
        np.testing.assert_array_equal(stored, np.float32(EXTREMES[name]).astype(np.float64))


def test_extreme_accepted_values_never_give_nan():
    rng = np.random.default_rng(23)
    logits = jnp.asarray(rng.normal(size=(8, V)).astype(np.float32) * 30)
    seen = [list(rng.choice(V, size=12, replace=False)) for _ in range(8)]
    hist = ll.History.create(seen, vocab_size=V, capacity=32)
    hist = hist.append(jnp.asarray([int(s[0]) for s in seen], jnp.int32))
    params = ll.SamplingParams.create(batch_size=8, seed=list(range(8)), logprobs=5, **EXTREMES)
    positions = jnp.ones(8, jnp.int32)
    out = jax.tree.map(np.asarray, ll.sample(logits, params, positions, hist))
    assert (out.status == ll.STATUS_OK).all(), out.status
    assert ((out.tokens >= 0) & (out.tokens < V)).all(), out.tokens
    for name, values in (
        ("logprobs", out.logprobs),
        ("raw_logprobs", out.raw_logprobs),
        ("top_logprobs.values", out.top_logprobs.values),
    ):
        assert not np.isnan(values).any(), f"{name}: {values}"
    assert np.isfinite(out.logprobs).all() and (out.logprobs <= 0).all(), out.logprobs
    probs = np.asarray(ll.sampling_distribution(logits, params, positions, hist), np.float64)
    assert not np.isnan(probs).any()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)

    # Row 0, temperature 1.17549e-38: every logit times 1/T past the float32 maximum
    # saturates there, so the row is uniform over those tokens (float64 reference).
    inv = np.float64(np.float32(1.0) / np.float32(F32_TINY))
    saturated = np.asarray(logits[0], np.float64) * inv >= F32_MAX
    assert saturated.sum() >= 2
    np.testing.assert_allclose(probs[0], saturated / saturated.sum(), atol=1e-6)


# Wrong types: each a ValueError naming the argument (and the row where there is one);
# nothing is coerced (1.5 -> 1, True -> 1, "0.5" -> 0.5, "no" -> True, 2-D -> flat).
BAD_TYPES = [
    ("banned_token_ids", [1.5], ["banned_token_ids", "1.5", "not a token id"]),
    ("banned_token_ids", [1, 2.7, 3], ["banned_token_ids", "2.7", "not a token id"]),
    ("banned_token_ids", [True], ["banned_token_ids", "True", "not a token id"]),
    ("banned_token_ids", [[1], [2.0], None], ["banned_token_ids[1]", "2.0"]),
    ("banned_token_ids", "12", ["banned_token_ids", "'12'"]),
    ("stop_token_ids", [[1], "x", None], ["stop_token_ids[1]", "'x'"]),
    ("allowed_token_ids", [2.0], ["allowed_token_ids", "2.0", "not a token id"]),
    ("allowed_token_ids", [[1], [2.5], None], ["allowed_token_ids[1]", "2.5"]),
    ("allowed_token_ids", 1.0, ["allowed_token_ids", "1.0"]),
    ("stop_sequences", [[1.5, 2]], ["stop_sequences", "1.5", "not a token id"]),
    ("stop_sequences", [[1, 2.7, 3]], ["stop_sequences", "2.7"]),
    ("stop_sequences", [["a"]], ["stop_sequences", "'a'", "not a token id"]),
    ("stop_sequences", [[[1, True]], None, None], ["stop_sequences[0]", "True"]),
    ("stop_sequences", [[[1]], [5], None], ["stop_sequences[1]", "5", "list of token ids"]),
    ("stop", [5], ["stop", "5", "non-empty str"]),
    ("stop", [["a"], [5], None], ["stop[1]", "5"]),
    ("stop", 5, ["stop", "5"]),
    ("stop", ["\ud800"], ["stop[0]", "not valid text", "U+D800"]),
    ("stop", ["ok", "a\udcffb"], ["stop[0]", "not valid text", "0xff"]),
    ("logit_bias", {True: 1.0}, ["logit_bias[0]", "True"]),
    ("logit_bias", {3: "1"}, ["logit_bias[0] token 3: bias", "'1'", "not a number"]),
    ("include_stop_str_in_output", "no", ["include_stop_str_in_output[0]", "'no'"]),
    ("include_stop_str_in_output", [True, 1, False], ["include_stop_str_in_output[1]"]),
    ("temperature", "0.5", ["temperature[0]", "'0.5'", "not a number"]),
    ("temperature", [1.0, "0.5", 1.0], ["temperature[1]", "'0.5'", "not a number"]),
    ("max_tokens", "8", ["max_tokens[0]", "'8'", "not a number"]),
    ("seed", b"1", ["seed[0]", "not a number"]),
    ("top_p", np.full((3, 1), 0.5), ["top_p", "shape (3, 1)", "(3,)"]),
]


@pytest.mark.parametrize(
    "arg, value, expected", BAD_TYPES, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_TYPES)]
)
def test_wrong_types_are_errors_naming_the_argument(arg, value, expected):
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=B, vocab_size=V, **{arg: value})
    message = str(err.value)
    for text in expected:
        assert text in message, f"{text!r} missing from: {message}"


def test_a_two_by_two_array_is_not_flattened_into_four_rows():
    with pytest.raises(ValueError, match=r"temperature is an array of shape \(2, 2\)"):
        ll.SamplingParams.create(batch_size=4, temperature=np.full((2, 2), 0.5))


def test_the_accepted_list_forms_still_mean_what_they_did():
    params = ll.SamplingParams.create(
        batch_size=B,
        vocab_size=V,
        banned_token_ids=np.asarray([1, 2]),
        stop_token_ids=7,
        allowed_token_ids=[[3, 4], None, 5],
        stop_sequences=[[1, 2], [3]],
        stop="x",
        include_stop_str_in_output=np.asarray([True, False, True]),
        temperature=np.float32(0.5),
    )
    assert np.asarray(params.banned_ids)[:, :2].tolist() == [[1, 2]] * B
    assert np.asarray(params.stop_token_ids)[:, 0].tolist() == [7] * B
    assert np.asarray(params.has_allowed).tolist() == [True, False, True]
    assert np.asarray(params.allowed_ids)[2, 0] == 5
    assert params.stop == (("x",),) * B
    assert params.include_stop_str_in_output == (True, False, True)


# Per-row lists of the wrong length: the message names the argument and both lengths.
WRONG_LENGTH = [
    ("temperature", [1.0, 0.5]),
    ("top_k", [1, 2, 3, 4]),
    ("seed", [0, 1]),
    ("logit_bias", [{1: 1.0}, {}]),
    ("banned_token_ids", [[1], [2]]),
    ("allowed_token_ids", [[1], None, [2], [3]]),
    ("stop_token_ids", [[1], [2]]),
    ("min_tokens", [0, 1]),
]


@pytest.mark.parametrize(
    "arg, value, expected", INVALID, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(INVALID)]
)
def test_invalid_value_names_argument_row_and_range(arg, value, expected):
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=B, vocab_size=V, **{arg: value})
    for text in expected:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


# A batch of one row names each value by its argument alone (its caller names the row: the
# CLI's "prompts.jsonl line 4: ...", generate_many's "requests[3]: ..."); the rest of the
# message is the batch's own.
ONE_ROW = [
    (dict(top_p=1.5), "top_p = 1.5 is outside the allowed range (0, 1]"),
    (dict(temperature=[1e-45]), "temperature = 1e-45 is outside the allowed range: 0 (greedy)"),
    (
        dict(min_tokens=5, max_tokens=4),
        "min_tokens = 5 is outside the allowed range [0, max_tokens = 4]",
    ),
    (dict(logit_bias={3: 500}), "logit_bias token 3: bias = 500 is outside"),
    (dict(logit_bias=[{True: 1.0}]), "logit_bias has key True"),
    (dict(banned_token_ids=[[V]]), f"banned_token_ids holds token id {V}, outside"),
    (dict(allowed_token_ids=[[]]), "allowed_token_ids is empty"),
    (dict(stop=[["a", 5]]), "stop holds 5; stop strings"),
    (dict(stop=["\ud800"]), r"stop '\ud800' is not valid text"),
    (dict(stop_sequences=[[[1], []]]), "stop_sequences holds an empty sequence"),
    (dict(stop_sequences=[[[V]]]), f"stop_sequences holds token id {V}, outside"),
    (dict(include_stop_str_in_output="no"), "include_stop_str_in_output = 'no' must be True"),
]


@pytest.mark.parametrize(
    "knobs, message", ONE_ROW, ids=[f"one-row-{i}" for i in range(len(ONE_ROW))]
)
def test_a_batch_of_one_row_names_no_row_index(knobs, message):
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=1, vocab_size=V, **knobs)
    assert str(err.value).startswith(message), str(err.value)
    assert "[0]" not in str(err.value), str(err.value)


def test_check_vocab_of_one_row_names_no_row_index():
    with pytest.raises(ValueError, match=r"^stop_token_ids holds token id 9, outside"):
        ll.SamplingParams.create(batch_size=1, stop_token_ids=[9]).check_vocab(5)
    with pytest.raises(ValueError, match=r"^stop_token_ids\[2\] holds token id 9, outside"):
        ll.SamplingParams.create(batch_size=3, stop_token_ids=[[], [], [9]]).check_vocab(5)


def test_stop_sequences_out_of_range_names_its_own_row():
    with pytest.raises(ValueError, match=r"^stop_sequences\[2\] holds token id 50, outside"):
        ll.SamplingParams.create(batch_size=3, vocab_size=V, stop_sequences=[None, [[1]], [[50]]])


@pytest.mark.parametrize("arg, value", WRONG_LENGTH, ids=[a for a, _ in WRONG_LENGTH])
def test_wrong_number_of_rows_names_argument_and_lengths(arg, value):
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=B, vocab_size=V, **{arg: value})
    message = str(err.value)
    assert arg in message and str(B) in message and str(len(value)) in message, message


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError) as err:
        ll.SamplingParams.create(batch_size=B, min_tokens=[0, 9, 0], max_tokens=[4, 8, 4])
    message = str(err.value)
    assert "min_tokens[1]" in message and "max_tokens" in message and "8" in message, message


def test_valid_values_at_the_edges_of_their_ranges_are_accepted():
    ll.SamplingParams.create(
        batch_size=B,
        vocab_size=V,
        temperature=[0.0, 1e-3, 100.0],
        top_p=[1.0, 1e-6, 0.5],
        min_p=[0.0, 1.0, 0.5],
        presence_penalty=[-2.0, 2.0, 0.0],
        frequency_penalty=[2.0, -2.0, 0.0],
        repetition_penalty=[1e-3, 1.0, 50.0],
        logprobs=[0, 20, 5],
        logit_bias={0: 1.0, V - 1: -1.0},
        banned_token_ids=[V - 1],
        allowed_token_ids=[[0], None, [V - 1]],
        stop_token_ids=[0, V - 1],
        min_tokens=[4, 0, 0],
        max_tokens=[4, 1, 1],
    )


# Rows that cannot be sampled.


def _unsampleable_batch():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(8, V)).astype(np.float32) * 3
    logits[1, 7] = np.nan
    logits[2, 3] = np.inf
    logits[3, :] = np.nan
    logits[5, :] = -np.inf
    params = ll.SamplingParams.create(
        batch_size=8,
        temperature=[1.0, 1.0, 0.7, 0.0, 1.0, 1.0, 0.0, 0.9],
        top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5],
        allowed_token_ids=[None, None, None, None, [5], None, [5, 6], None],
        banned_token_ids=[[], [], [], [], [5], [], [], []],
        stop_token_ids=[[], [], [], [], [], [], [5, 6], []],
        min_tokens=[0, 0, 0, 0, 0, 0, 3, 0],
        seed=list(range(8)),
        logprobs=5,
        vocab_size=V,
    )
    return jnp.asarray(logits), params, jnp.zeros(8, jnp.int32)


# row -> expected status: 1, 2, 3 hold NaN / +inf / all-NaN; 4 allows only a banned token,
# 5 is all -inf, 6 allows only stop tokens that min_tokens suppresses; 0 and 7 are fine.
EXPECTED_STATUS = {
    0: ll.STATUS_OK,
    1: ll.STATUS_BAD_LOGITS,
    2: ll.STATUS_BAD_LOGITS,
    3: ll.STATUS_BAD_LOGITS,
    4: ll.STATUS_ALL_MASKED,
    5: ll.STATUS_ALL_MASKED,
    6: ll.STATUS_ALL_MASKED,
    7: ll.STATUS_OK,
}


def test_bad_logits_and_fully_masked_rows_get_their_status():
    logits, params, positions = _unsampleable_batch()
    out = ll.sample(logits, params, positions)
    assert {r: int(s) for r, s in enumerate(out.status)} == EXPECTED_STATUS
    assert ll.STATUS_OK == 0 and ll.STATUS_ALL_MASKED == 1 and ll.STATUS_BAD_LOGITS == 2


def test_unsampleable_rows_give_a_valid_token_and_no_nan():
    logits, params, positions = _unsampleable_batch()
    out = jax.tree.map(np.asarray, ll.sample(logits, params, positions))
    assert ((out.tokens >= 0) & (out.tokens < V)).all(), out.tokens
    for name, values in (
        ("logprobs", out.logprobs),
        ("raw_logprobs", out.raw_logprobs),
        ("top_logprobs.values", out.top_logprobs.values),
    ):
        assert not np.isnan(values).any(), f"{name}: {values}"
    probs = np.asarray(ll.sampling_distribution(logits, params, positions))
    assert not np.isnan(probs).any()


def test_unsampleable_rows_do_not_disturb_the_others():
    logits, params, positions = _unsampleable_batch()
    out = ll.sample(logits, params, positions)
    good = np.asarray([0, 7])
    alone = ll.sample(logits[good], params.take(good), positions[good])
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(lambda v: v[good], out)), jax.tree.leaves(alone), strict=True
    ):
        np.testing.assert_array_equal(a, b)


# Bad prompts: a ValueError naming the prompt, before anything compiles.
BAD_PROMPTS = [
    (["abc\ud800def"], ["prompts[0]", "not valid text", "U+D800", "character 3"]),
    (["ok", "bad \udcff byte"], ["prompts[1]", "not valid text", "0xff"]),
    ([b"abc"], ["prompts[0]", "bytes", "decode"]),
    ([1, 2, 3], ["flat list of token ids", "[[1, 2, 3]]"]),
    ([[1, 2.7, 3]], ["prompts[0]", "2.7", "not a token id"]),
    ([[1, True]], ["prompts[0]", "True", "not a token id"]),
    ([None], ["prompts[0]", "NoneType"]),
    (b"abc", ["prompts must be a list", "bytes"]),
]


@pytest.fixture(scope="module")
def shipped_model():
    return ll.load_pretrained()


@pytest.mark.parametrize(
    "prompts, expected", BAD_PROMPTS, ids=[f"prompt-{i}" for i in range(len(BAD_PROMPTS))]
)
def test_bad_prompts_are_errors_naming_the_prompt(shipped_model, prompts, expected):
    batch = len(prompts) if isinstance(prompts, list) else 1
    params = ll.SamplingParams.create(batch_size=batch, max_tokens=2)
    with pytest.raises(ValueError) as err:
        ll.generate(shipped_model, prompts, params)
    for text in expected:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"


# ll.sample's inputs whose shapes do not fit: one line naming what is wrong, at trace time.
def _shape_case(
    logits_shape=(B, V),
    params_batch=B,
    positions_shape=(B,),
    history_batch=None,
    vocab_size=None,
    ids=None,
):
    logits = jnp.zeros(logits_shape, jnp.float32)
    params = ll.SamplingParams.create(batch_size=params_batch, vocab_size=vocab_size, **(ids or {}))
    positions = jnp.zeros(positions_shape, jnp.int32)
    history = None
    if history_batch is not None:
        history = ll.History.create([[1]] * history_batch, vocab_size=V, capacity=8)
    return logits, params, positions, history


BAD_SHAPES = [
    (dict(logits_shape=(V,), params_batch=1), "logits must be [B, V] (2-D), got shape (50,)"),
    (dict(logits_shape=(1, 2, V), params_batch=1), "got shape (1, 2, 50)"),
    (dict(logits_shape=(B, 0)), "V = 0"),
    (dict(params_batch=B + 1), f"params has batch_size {B + 1} but logits have {B} rows"),
    (dict(positions_shape=()), f"positions must be [B] = ({B},), one per row, got shape ()"),
    (dict(positions_shape=(B + 2,)), f"got shape ({B + 2},)"),
    (dict(history_batch=B - 1), f"history has {B - 1} rows but logits have {B}"),
    (
        dict(vocab_size=V + 14, ids=dict(banned_token_ids=[V + 3])),
        f"vocab_size = {V + 14}, but the logits have V = {V}",
    ),
    (dict(vocab_size=V + 1, ids=dict(logit_bias={V: 1.0})), f"V = {V}"),
    (dict(vocab_size=V + 1, ids=dict(allowed_token_ids=[0, V])), f"V = {V}"),
]


@pytest.mark.parametrize(
    "case, message", BAD_SHAPES, ids=[f"shape-{i}" for i in range(len(BAD_SHAPES))]
)
def test_sample_rejects_inputs_that_do_not_fit(case, message):
    logits, params, positions, history = _shape_case(**case)
    for fn in (ll.sample, ll.sampling_distribution):
        with pytest.raises(ValueError) as err:
            jax.eval_shape(fn, logits, params, positions, history)  # trace only, no run
        text = str(err.value)
        assert message in text and "\n" not in text, text


def test_params_are_composed_of_parts_with_one_job_each():
    """Every field lives in one part (the sampler's knobs, the stop rules, the output
    options) and reads the same as an attribute of the params; `replace` by field name
    changes that part alone."""
    p = ll.SamplingParams.create(2, temperature=[0.5, 0.0], max_tokens=3, stop="x", logprobs=1)
    assert p.temperature is p.knobs.temperature and p.seed is p.knobs.seed
    assert p.max_tokens is p.stops.max_tokens and p.stop == p.stops.stop == (("x",), ("x",))
    assert p.logprobs is p.output.logprobs
    q = p.replace(top_p=jnp.full((2,), 0.5), max_tokens=jnp.full((2,), 7, jnp.int32))
    assert q.top_p.tolist() == [0.5, 0.5] and q.max_tokens.tolist() == [7, 7]
    assert q.temperature is p.temperature and q.output is p.output and q.stop == p.stop
