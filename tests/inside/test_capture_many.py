"""Capture in `generate_many` (issue 72): more requests than slots, prompts of different
lengths and rows of different lengths (refills: each row enters at its own step, and its
states go to its own column), on the paged pool with the prefix cache and on the
contiguous slots: each request's states equal transformers' `output_hidden_states` on its
final sequence and `generate(..., capture=)`'s for the same row; a second job of the same
bounds and layers compiles nothing; bad input is refused by name before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import logitloop as ll  # noqa: E402
from tests.models.tiny_checkpoints import random_prompts  # noqa: E402

from .test_inside import ATOL, WIDTH, hf_states  # noqa: E402

PAGE = 4
# Five prompts through two slots; the third and the fifth start with the first's 8 tokens
# (two full pages the prefix cache serves them).
LENGTHS = [9, 5, 11, 7, 10]
TOKENS = [6, 3, 5, 2, 4]
JOB = dict(
    slots=2, prefill_batch=1, chunk_steps=2, max_prompt_len=12, max_tokens_bound=6,
    temperature=0, ignore_eos=True, page_size=PAGE,
)  # fmt: skip
PAGED = dict(JOB, kv_cache_tokens=96)  # the prefix cache on (the default)
CAPTURE = ll.Capture(layers=(0,), final_norm=True)


def prompts(seed: int = 40) -> list[list[int]]:
    rows = random_prompts(160, LENGTHS, seed)
    return [*rows[:2], *(rows[0][:8] + p[8:] if len(p) > 8 else p for p in rows[2:])]


def requests(rows: list[list[int]]) -> list[ll.Request]:
    return [ll.Request(p, dict(max_tokens=t)) for p, t in zip(rows, TOKENS, strict=False)]


def check_against_transformers(hf, rows, out, prompt: bool) -> None:
    """Each request's states, each of its rows': layer 0 and the final norm's output at
    every token of its sequence that a pass fed (the prompt's too with `prompt`),
    transformers' values."""
    for row, result in zip(rows, out, strict=True):
        assert len(result.captured) == len(result.token_ids)
        for tokens, got in zip(result.token_ids, result.captured, strict=True):
            hs = hf_states(hf, row + tokens)
            want = np.stack([hs[1], hs[-1]], axis=1)[:-1]  # the last token is never fed
            want = want if prompt else want[len(row) - 1 :]
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_paged_prefix_cached_job_captures_what_transformers_and_generate_do(setup):
    """The paged pool, the prefix cache serving two pages to two rows: each request's
    generated tokens' states equal transformers' and `generate`'s (one batch of all)."""
    model, rows, stats = setup["model"], prompts(), {}
    out = ll.generate_many(model, requests(rows), capture=CAPTURE, stats=stats, **PAGED)
    assert stats["cached_tokens"] == 2 * 2 * PAGE  # two rows read two shared pages each
    check_against_transformers(setup["hf"], rows, out, prompt=False)
    want = ll.generate(model, rows, capture=CAPTURE, temperature=0, ignore_eos=True,
                       max_new_tokens=TOKENS)  # fmt: skip
    for i, result in enumerate(out):
        assert result.token_ids == [want.token_ids[i]]
        np.testing.assert_allclose(result.captured[0], want.captured[i], rtol=0, atol=ATOL)


def test_prompt_capture_runs_every_prompt_whole_and_equals_transformers(setup):
    """`Capture(prompt=True)` on the contiguous slots (the prefix cache off by default):
    every token of prompt + completion but the last, as transformers gives them."""
    model, rows = setup["model"], prompts()
    capture = ll.Capture(layers=(0,), prompt=True, final_norm=True)
    out = ll.generate_many(model, requests(rows), capture=capture, **JOB)
    check_against_transformers(setup["hf"], rows, out, prompt=True)


def test_a_second_job_of_the_same_layers_compiles_nothing(setup, compile_counter):
    """A second job of the same bounds and captured layers (another `Capture` with them,
    other prompts read from a generator): no program compiles, and its states are
    transformers'."""
    model = setup["model"]
    ll.generate_many(model, requests(prompts()), capture=CAPTURE, **PAGED)
    rows = prompts(41)
    again = ll.Capture(layers=[0], final_norm=True, max_bytes=2**20)

    def lazily():
        yield from requests(rows)

    with compile_counter as c:
        out = dict(ll.iter_generate_many(model, lazily(), capture=again, **PAGED))
    assert c.count == 0
    check_against_transformers(setup["hf"], rows, [out[i] for i in range(len(rows))], False)


def test_steered_requests_capture_their_steered_states(setup):
    """Steering and capture in one job (per-request vectors beside unsteered requests):
    each request's tokens and states are `generate`'s with the same vectors."""
    model, rows = setup["model"], prompts(44)[:3]
    vector = np.random.default_rng(3).normal(size=WIDTH).astype(np.float32)
    steers = [ll.Steer(vector, 0, 6.0), None, ll.Steer(vector, 1, 4.0, tokens="generated")]
    many = [ll.Request(p, dict(max_tokens=t), steer=s or [])
            for p, t, s in zip(rows, TOKENS, steers, strict=False)]  # fmt: skip
    out = ll.generate_many(model, many, capture=CAPTURE, **PAGED)
    want = ll.generate(model, rows, steer=steers, capture=CAPTURE, temperature=0,
                       ignore_eos=True, max_new_tokens=TOKENS[:3])  # fmt: skip
    for i, result in enumerate(out):
        assert result.token_ids == [want.token_ids[i]]
        np.testing.assert_allclose(result.captured[0], want.captured[i], rtol=0, atol=ATOL)


@pytest.mark.parametrize("prompt", [False, True])
def test_each_of_n_samples_captures_its_own_sequence(setup, prompt):
    """`n = 2` sampled rows a request on a pool: rows sharing their prompt's pages
    (`prompt=False`), or each prefilling it whole (`prompt=True`: no row shares): every
    row's states are transformers' on its own sequence."""
    rows = prompts(45)[:3]
    capture = ll.Capture(layers=(0,), prompt=prompt, final_norm=True)
    keywords = {**PAGED, "temperature": 1.0, "seed": 7, "n": 2}
    out = ll.generate_many(setup["model"], requests(rows), capture=capture, **keywords)
    assert any(r.token_ids[0] != r.token_ids[1] for r in out)  # the samples differ
    check_against_transformers(setup["hf"], rows, out, prompt=prompt)


@pytest.mark.slow
def test_preempted_rows_keep_their_states(setup):
    """A pool too small for two rows' growth: rows are preempted and resumed (keys and
    values recomputed, nothing captured again), and every row's states are still
    transformers'."""
    model, rows, stats = setup["model"], random_prompts(160, [10, 9, 10, 8], 42), {}
    keywords = dict(PAGED, kv_cache_tokens=24, prefix_cache=False, max_tokens=6)
    out = ll.generate_many(model, rows, capture=CAPTURE, stats=stats, **keywords)
    assert stats["preemptions"] > 0
    check_against_transformers(setup["hf"], rows, out, prompt=False)


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(capture=ll.Capture(layers=0, prompt=True), prefix_cache=True),
         r"prefix_cache=True with capture=ll\.Capture\(prompt=True\)"),
        (dict(capture=ll.Capture(layers=0, prompt=True, max_bytes=10_000)),
         r"capture=: the buffer would take .* MiB \(2 rows x 32 tokens x 1 layers x 64 floats"),
        (dict(capture=ll.Capture(layers=(0, 2))), r"capture\.layers\[1\] = 2 is out of range"),
        (dict(capture=ll.Capture(layers=0), speculative=ll.PromptLookup()), "speculative="),
        (dict(capture=(0,)), "capture must be an ll.Capture"),
    ],
)  # fmt: skip
def test_bad_capture_is_refused_by_name(setup, keywords, match, compile_counter):
    with compile_counter as c, pytest.raises((ValueError, NotImplementedError), match=match):
        ll.generate_many(setup["model"], [[1, 2, 3], [4, 5]], **{**JOB, **keywords})
    assert c.count == 0  # refused before anything runs
    assert WIDTH == 64  # the sizes above are the tiny Llama's


@pytest.mark.slow
def test_own_models_job_captures_the_familys_states(setup):
    """examples/own_model.py (its residual width said by no config: the job traces a
    one-token pass to size the buffer) in a job with refills: the family's states."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import own_model

    llama, rows = setup["model"], prompts(43)
    mine = ll.from_nnx(own_model.from_llama(llama), vocab_size=160, max_length=64)
    capture = ll.Capture(layers=(1, 0))  # it marks no final norm
    got = ll.generate_many(mine, requests(rows), capture=capture, **PAGED)
    want = ll.generate_many(llama, requests(rows), capture=capture, **PAGED)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.captured[0], b.captured[0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"2 rows x 32 tokens x 2 layers x 64 floats"):
        ll.generate_many(mine, rows, capture=ll.Capture(layers=(0, 1), prompt=True,
                         max_bytes=1000), **JOB)  # fmt: skip
