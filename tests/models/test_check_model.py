"""`ll.check_model` on the tests' own user model (`tests/models/user_model.py`, a plain-
function `FunctionModel` through `ll.attention`): the model passes; each broken variant is
reported with its cause, and the variants the contract refuses also make `ll.generate`
raise at its first call, naming the layer and the mismatch.

Cheap: the correct model's check compiles five programs (module fixture); the variants that
compute wrongly are the same `apply_fn` with a switch in their params (no compile), and
those the contract refuses are refused while traced (no compile either)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine import check
from tests.models import user_model

MAX_LENGTH = 16


def _model(bug: str | None = None, **switches) -> ll.FunctionModel:
    params = user_model.init_params(**switches)
    return user_model.model(params, max_length=MAX_LENGTH, bug=bug)


@pytest.fixture(scope="module")
def correct_report() -> ll.CheckReport:
    """The correct model's check (it compiles the programs the switched variants reuse)."""
    return ll.check_model(_model())


def test_a_correct_model_passes(correct_report, compile_counter):
    assert correct_report.ok, str(correct_report)
    assert len(correct_report.comparisons) == 4
    assert all(c.ok and c.max_abs_diff < 1e-5 for c in correct_report.comparisons)
    assert str(correct_report).startswith("check_model: OK")
    with compile_counter:  # once per shape: another model of the same apply_fn reuses them
        assert ll.check_model(_model(train_q_scale=1.0)).ok
    assert compile_counter.count == 0


def _only(report: ll.CheckReport, kind: str, comparisons: set[str]) -> list[check.Finding]:
    assert not report.ok
    assert {f.kind for f in report.findings} == {kind}, str(report)
    failed = {c.name for c in report.comparisons if not c.passed}
    assert failed == comparisons, str(report)
    return list(report.findings)


def test_positions_ignored_is_reported(correct_report):
    """RoPE by the column index: a whole prompt in one call still matches (relative
    rotations agree), a decode step does not."""
    report = ll.check_model(_model(column_positions=True))
    (finding,) = _only(report, check.POSITIONS, {"decode steps vs kv=None"})
    assert "jnp.arange(T)" in finding.cause and finding.max_abs_diff > 0.1
    assert "[positions] decode steps vs kv=None" in str(report)


def test_kv_none_computing_otherwise_is_reported(correct_report):
    """Another computation with kv=None: the unpadded prompt in one call differs already,
    and the padded rows and decode steps are put down to it."""
    report = ll.check_model(_model(train_q_scale=2.0))
    findings = _only(
        report,
        check.KV_NONE,
        {"unpadded prompt in one call vs kv=None", "left-padded prompt vs kv=None",
         "decode steps vs kv=None"},
    )  # fmt: skip
    assert "kv=None" in findings[0].cause and "masks" in findings[0].cause
    assert all("follows from" in f.cause for f in findings[1:])


def test_paged_differing_from_contiguous_is_reported(correct_report):
    report = ll.check_model(_model(paged_offset=0.5))
    (finding,) = _only(report, check.PAGED, {"paged pool vs contiguous cache"})
    assert abs(finding.max_abs_diff - 0.5) < 1e-3


def test_a_masked_vocabulary_entry_hides_no_difference(correct_report):
    """A -inf logit (a masked entry, -inf in every pass) agrees with itself and does not
    widen the tolerance of the others: the correct model still passes, and one that
    rotates by the column index is still reported (the tolerance once scaled with the
    row's largest |logit|, inf, and passed everything)."""
    masked = np.zeros(user_model.V, np.float32)
    masked[0] = -np.inf
    assert ll.check_model(_model(vocab_offset=masked)).ok
    report = ll.check_model(_model(column_positions=True, vocab_offset=masked))
    (finding,) = _only(report, check.POSITIONS, {"decode steps vs kv=None"})
    assert np.isfinite(finding.max_abs_diff) and finding.max_abs_diff > 0.1


def test_logits_gone_nan_or_infinite_on_one_side_are_reported(correct_report):
    nan = ll.check_model(_model(vocab_offset=np.full(user_model.V, np.nan, np.float32)))
    assert not nan.ok and {f.kind for f in nan.findings} == {check.NON_FINITE}, str(nan)
    assert len(nan.findings) == 4 and all(not c.passed for c in nan.comparisons)
    assert "[non-finite] unpadded prompt in one call vs kv=None: row 0" in str(nan)
    assert "NaN" in nan.findings[0].cause
    paged = ll.check_model(_model(paged_offset=-np.inf))  # -inf over the paged pool only
    (finding,) = _only(paged, check.NON_FINITE, {"paged pool vs contiguous cache"})
    assert finding.what.startswith("paged pool vs contiguous cache: row 0, position 0")


def test_tolerances_that_pass_everything_are_refused():
    for name, value in (("atol", float("nan")), ("rtol", float("inf")), ("atol", -1e-3)):
        with pytest.raises(ValueError, match=f"{name} must be None or a finite float >= 0"):
            ll.check_model(_model(), **{name: value})


# The contract's own errors: (bug, words the message holds).
REFUSALS = [
    ("shape", ["apply_fn returned logits of shape", "(2, 9, 95)", "vocab_size"]),
    ("input kv", ["apply_fn returned a kv in which no layer was written", "ll.attention gave"]),
    ("twice", ["ll.attention(layer=0)", "already written"]),
    ("never", ["layer(s) [1]", "never written"]),
    ("heads", ["ll.attention(layer=0)", "1 heads", "num_kv_heads=2"]),
    ("dtype", ["ll.attention(layer=0)", "k is bfloat16", "KVSpec's dtype is float32"]),
]


@pytest.mark.parametrize(("bug", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_contract_errors_are_reported_and_generate_raises(bug, words):
    model = _model(bug)
    report = ll.check_model(model)
    assert [f.kind for f in report.findings] == [check.REFUSED], str(report)
    assert report.comparisons == ()
    for word in words:
        assert word in report.findings[0].cause, (word, str(report))
    assert "[refused]" in str(report)
    with pytest.raises((ValueError, TypeError)) as e:
        ll.generate(model, [[1, 2, 3]], max_new_tokens=2, temperature=0.0)
    for word in words:
        if word != "(2, 9, 95)":  # generate's call has its own shape
            assert word in str(e.value), (word, str(e.value))


def test_a_model_with_a_cache_of_its_own_is_refused():
    model = ll.FunctionModel(
        user_model.apply_fn, user_model.init_params(), init_cache=lambda b, s: None,
        vocab_size=user_model.V, max_length=MAX_LENGTH,
    )  # fmt: skip
    with pytest.raises(ValueError, match="ll.check_model needs a model whose attention"):
        ll.check_model(model)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        ll.check_model(_model(), steps=0)
    with pytest.raises(ValueError, match="prompt_len \\+ steps = 17 exceeds"):
        ll.check_model(_model(), prompt_len=14)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "llama-bf16", "gemma-ring"])
def test_logitloop_families_pass(case):
    """The families through the same check (the full forward is theirs with
    `all_columns=True`): a bfloat16 model within its default tolerances, and a window
    layer the contiguous cache keeps as a ring (window 2 + `RING_SLACK` < 12 slots)."""
    from tests.decoding.random_llama import small_gemma, small_llama

    if case == "gemma-ring":
        model, steps = small_gemma(64, 32, 0, sliding_windows=(2, None)), 6
    else:
        dtype = jnp.bfloat16 if case == "llama-bf16" else None
        model, steps = small_llama(64, 32, 0, dtype=dtype), 3
    report = ll.check_model(model, steps=steps)
    assert report.ok, str(report)
