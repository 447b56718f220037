"""Classifier-free guidance in `generate_many` (issue 72): guided and unguided requests
through fewer slots than requests get `generate`'s tokens for the same prompts and
guidance (which tests/decoding/test_guidance.py holds equal to transformers'), on the
contiguous slots and on a paged pool small enough to preempt pairs; a second job with
other scales and negative prompts compiles nothing; bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine.batching import Request, generate_many, iter_generate_many
from tests.decoding.random_llama import small_llama

V = 48
TOKENS = 6
GREEDY = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
BOUNDS = dict(slots=4, chunk_steps=2, prefill_batch=2, max_prompt_len=12, max_tokens_bound=8)


@pytest.fixture(scope="module")
def model():
    return small_llama(V, 64, 5)


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, V, n)] for n in lengths]


def _cases(seed: int, scales=(2.0, 3.0, None, 0.5, None, 1.5)):
    """Six requests: a negative prompt, the default negative (the last prompt token),
    unguided, a scale below 1 with a negative prompt, unguided, the default negative."""
    prompts = _prompts([6, 4, 7, 5, 3, 9], seed)
    negatives = _prompts([4, 9, 3], seed + 1)
    negative = [negatives[0], None, None, negatives[1], None, negatives[2]]
    negative[5] = None if scales[5] is None else negatives[2]
    return prompts, list(scales), negative


def _requests(prompts, scales, negative):
    return [
        Request(p, guidance_scale=s, negative_prompt=n)
        for p, s, n in zip(prompts, scales, negative, strict=True)
    ]


def _assert_equal_generate(model, results, prompts, scales, negative, n=1):
    want = ll.generate(model, prompts, guidance_scale=scales, negative_prompt=negative, **GREEDY)
    for r, result in enumerate(results):
        assert result.token_ids == [want.token_ids[r]] * n, r
        for got in result.raw_logprobs:
            np.testing.assert_allclose(got, want.raw_logprobs[r], rtol=0, atol=1e-4)


def test_guided_requests_through_refilled_slots_equal_generate(model):
    """Six requests, four of them guided (two slots each), through 4 contiguous slots."""
    prompts, scales, negative = _cases(0)
    out = generate_many(
        model, _requests(prompts, scales, negative), prefix_cache=False, **BOUNDS, **GREEDY
    )
    _assert_equal_generate(model, out, prompts, scales, negative)


def test_a_small_pool_preempts_pairs_together_and_keeps_the_tokens(model):
    """A pool of 12 pages of 4 tokens for 5 slots (a pair the free slots would cut
    waits): pairs wait for pages and are preempted and resumed together; a prefix cache
    (the default) beside them, n = 2 (each sample its own negative row)."""
    prompts, scales, negative = _cases(0)
    stats = {}
    out = generate_many(
        model, _requests(prompts, scales, negative), n=2, kv_cache_tokens=48, page_size=4,
        stats=stats, **{**BOUNDS, "slots": 5}, **GREEDY,
    )  # fmt: skip
    _assert_equal_generate(model, out, prompts, scales, negative, n=2)
    assert stats["preemptions"] > 0 and stats["resumed"] == stats["preemptions"]


@pytest.mark.slow  # the fixed-order programs (~35 s to compile on 2 loaded cores)
def test_deterministic_guided_requests_are_generates_bit_for_bit(model):
    prompts, scales, negative = _cases(0)
    out = generate_many(
        model, _requests(prompts, scales, negative), deterministic=True, prefix_cache=False,
        **BOUNDS, **GREEDY,
    )  # fmt: skip
    want = ll.generate(
        model, prompts, guidance_scale=scales, negative_prompt=negative, deterministic=True,
        **GREEDY,
    )  # fmt: skip
    for r, result in enumerate(out):
        assert result.token_ids == [want.token_ids[r]], r
        got, bits = (
            np.asarray(x, np.float32) for x in (result.raw_logprobs[0], want.raw_logprobs[r])
        )
        assert np.array_equal(got, bits), r


def test_finished_pairs_leave_their_slots_unguided(model):
    """A pair's slots are freed with their guidance: after the job every slot is its own
    negative and parent again at scale 1 (a stale link would make an empty slot follow the
    next row admitted to its old partner's slot)."""
    from logitloop.decoding.engine.batcher import _Batcher
    from logitloop.decoding.engine.plan import Options, plan

    job = plan(model, Options(ignore_eos=True), guidance=True)
    bounds = {**BOUNDS, "max_tokens": BOUNDS["max_tokens_bound"]}
    del bounds["max_tokens_bound"]
    batcher = _Batcher(job, **bounds, defaults=dict(temperature=0, max_tokens=TOKENS))
    assert len(list(batcher.run(_requests(*_cases(0))))) == 6
    slots = np.arange(BOUNDS["slots"])
    np.testing.assert_array_equal(batcher.guidance.negative, slots)
    np.testing.assert_array_equal(batcher.guidance.parent, slots)
    np.testing.assert_array_equal(batcher.guidance.scale, np.ones(BOUNDS["slots"]))


def test_a_job_of_other_scales_and_negative_prompts_compiles_nothing(model, compile_counter):
    """The slots' guidance tables are data: after a first guided job, a job of other
    scales, negative prompts and job-wide defaults compiles 0 programs."""
    prompts, scales, negative = _cases(3)
    generate_many(
        model, _requests(prompts, scales, negative), prefix_cache=False, **BOUNDS, **GREEDY
    )
    prompts, scales, negative = _cases(4, scales=(0.5, None, 4.0, 2.0, 1.0, None))
    with compile_counter as c:
        out = generate_many(
            model, _requests(prompts, scales, negative), prefix_cache=False, **BOUNDS, **GREEDY
        )
    assert c.count == 0
    _assert_equal_generate(model, out, prompts, scales, negative)


def test_job_wide_guidance_is_every_requests_default(model):
    prompts = _prompts([5, 6], 7)
    negative = _prompts([3], 8)[0]
    requests = [Request(prompts[0]), Request(prompts[1], guidance_scale=1)]  # 1: unguided
    out = generate_many(
        model, requests, guidance_scale=2.0, negative_prompt=negative, prefix_cache=False,
        **BOUNDS, **GREEDY,
    )  # fmt: skip
    _assert_equal_generate(model, out, prompts, [2.0, None], [negative, None])


def test_steered_and_captured_guided_requests_equal_generate(model):
    """Guided requests beside steering (a negative row steered as its row) and the job's
    capture (the real rows' states) on a prefix-cached pool: `generate`'s tokens, raw
    log-probabilities and captured states for the same prompts and settings."""
    prompts, scales, negative = _cases(9)
    rng = np.random.default_rng(10)
    vectors = [rng.normal(size=32).astype(np.float32) for _ in range(2)]
    steer = [ll.Steer(vectors[0], 0, 6.0), None, ll.Steer(vectors[1], 1, -4.0), None,
             ll.Steer(vectors[1], 0, 3.0, tokens="prompt"), None]  # fmt: skip
    capture = ll.Capture(layers=(1,))
    requests = [
        Request(p, guidance_scale=sc, negative_prompt=n, steer=st or [])
        for p, sc, n, st in zip(prompts, scales, negative, steer, strict=True)
    ]
    out = generate_many(model, requests, capture=capture, **BOUNDS, **GREEDY)
    want = ll.generate(
        model, prompts, guidance_scale=scales, negative_prompt=negative, steer=steer,
        capture=capture, **GREEDY,
    )  # fmt: skip
    for r, result in enumerate(out):
        assert result.token_ids == [want.token_ids[r]], r
        np.testing.assert_allclose(result.raw_logprobs[0], want.raw_logprobs[r], atol=1e-4)
        np.testing.assert_allclose(result.captured[0], want.captured[r], rtol=0, atol=2e-4)


@pytest.mark.parametrize(
    "request_, keywords, error, message",
    [
        (dict(guidance_scale=float("nan")), {}, ValueError,
         r"requests\[0\]: guidance_scale = nan is not finite"),
        (dict(guidance_scale="2"), {}, ValueError, "guidance_scale must be a finite number"),
        (dict(negative_prompt=[4, 5]), {}, ValueError,
         "negative_prompt= is given without guidance_scale="),
        (dict(guidance_scale=2.0, negative_prompt=[999]), {}, ValueError,
         r"requests\[0\]: negative_prompt holds"),
        (dict(guidance_scale=2.0, negative_prompt=[4] * 13), {}, ValueError,
         "negative_prompt has 13 tokens, over max_prompt_len = 12"),
        (dict(guidance_scale=2.0), dict(prefill_batch=1), ValueError,
         "a guided request needs prefill_batch >= 2"),
        (dict(guidance_scale=2.0), dict(slots=1, prefill_batch=1), ValueError,
         r"requests\[0\]: a guided request needs 2 slots \(its row and its negative row\), "
         "got slots = 1"),
        ({}, dict(guidance_scale=[2.0, 3.0]), ValueError,
         "guidance_scale= of generate_many is every request's default: one number"),
        ({}, dict(guidance_scale=2.0, negative_prompt=[[4], [5]]), ValueError,
         "negative_prompt= of generate_many is every request's default"),
        (dict(guidance_scale=2.0), dict(speculative=ll.PromptLookup()), NotImplementedError,
         "guidance_scale= does not run with speculative="),
    ],
)  # fmt: skip
def test_bad_input_is_refused_by_name(model, request_, keywords, error, message):
    bounds = {**BOUNDS, **{k: keywords.pop(k) for k in list(keywords) if k in BOUNDS}}
    with pytest.raises(error, match=message):
        generate_many(model, [Request([3, 4], **request_)], **bounds, **keywords, **GREEDY)


def test_a_generators_guided_request_needs_a_prefill_batch_of_two(model):
    """A generator's requests are read as the job runs: the default prefill_batch (1 for
    4 slots) cannot prefill a pair, and the guided request is refused by its index."""
    requests = (Request([3, 4], guidance_scale=2.0 if i else None) for i in range(2))
    bounds = {k: v for k, v in BOUNDS.items() if k != "prefill_batch"}
    with pytest.raises(ValueError, match=r"requests\[1\]: a guided request needs prefill_batch"):
        list(iter_generate_many(model, requests, **bounds, **GREEDY))
