"""Shared prefixes (issue 45): `generate(..., n=N)` prefills each prompt once and its rows
share its pages; `generate_many` shares the full pages of common prompt prefixes across
requests (`prefix_cache`, on by default). Every row's results are those of its prompt
prefilled alone: tokens equal, and bit for bit under `deterministic=True`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine import generate as generate_module
from logitloop.decoding.engine.batching import Request, generate_many
from logitloop.decoding.engine.host import prompt_batch, suffix_batch
from logitloop.decoding.engine.prefix_cache import PrefixCache, page_keys
from logitloop.decoding.loop import speculative
from logitloop.decoding.loop.decode_loop import Program, PromptBatch, Tables, speculation_state
from logitloop.decoding.loop.runner import model_info
from tests.decoding.random_llama import small_llama

PAGE = 16  # generate_many's default page size
# One set of bounds for every job here: the jobs share their compiled programs.
BOUNDS = dict(slots=4, prefill_batch=2, chunk_steps=4, max_prompt_len=64, max_tokens_bound=12)
POOL = 4 * (64 + 16)  # the default pool of BOUNDS: 4 slots of the buckets' 64 + 16 tokens


@pytest.fixture(scope="module")
def shipped():
    return ll.load_pretrained(dtype="float32")  # with its tokenizer: stop strings, regexes


@pytest.fixture(scope="module")
def llama():
    """For the generate_many jobs, which need no tokenizer: a 2-layer float32 Llama
    (grouped-query heads of 8) runs them in about 70% of the shipped model's time (the
    compiles dominate). The n-rows test keeps the shipped model: this one's large logits
    (weights 25x the default init) put its float32 cascade path 3e-5 from the plain one."""
    return small_llama(256, 128, 4)


def _prompt(seed: int, length: int, vocab: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, length).tolist()


def _same(got, want, bits: bool):
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    if bits:
        assert got.raw_logprobs == want.raw_logprobs
        assert got.logprobs == want.logprobs


# ----------------------------------------------------------------------------- generate


@pytest.mark.slow  # its default twin: tests/models/test_own_model.py (n = 4, 37 tokens)
def test_n_rows_equal_single_row_runs(shipped, monkeypatch):
    """`n = 16` rows of a 37-token prompt (two full pages and a partial one, shared and
    copied) against the prompt given 16 times, each row with its own seed and its own
    prefill in the contiguous cache: bit for bit under `deterministic=True` (in which a row
    in a batch is the row alone, `test_deterministic.py`); in float32, where each decode
    step reads the two shared pages once for the 16 rows (`paged.cascade_attention`), the
    same tokens and logprobs to float32 rounding. The prompt is prefilled once
    (`_forked_state`), and every row shares both pages."""
    from logitloop.ops.attention import paged

    shared = []
    start = generate_module._forked_state

    def forked_state(*args):
        plan, state = start(*args)
        pool = state.pages.pages  # read before `decode` takes (donates) the state
        zeros = jnp.zeros_like(pool.lengths)
        shared.append(paged.shared_entries(pool.tables, zeros, state.cache[0]["prefix"], PAGE))
        return plan, state

    monkeypatch.setattr(generate_module, "_forked_state", forked_state)
    prompt = _prompt(0, 37)
    knobs = dict(temperature=1.0, max_tokens=6, seed=7, logprobs=1, ignore_eos=True)
    got = ll.generate(shipped, [prompt], n=16, deterministic=True, **knobs)
    assert len(shared) == 1
    rows = ll.SamplingParams.create(1, **{k: v for k, v in knobs.items() if k != "ignore_eos"})
    want = ll.generate(
        shipped, [prompt] * 16, rows.samples(16), deterministic=True, ignore_eos=True
    )
    assert len(shared) == 1  # 16 prompts of n = 1 are not forked
    _same(got, want, bits=True)
    assert len({tuple(t) for t in got.token_ids}) > 1  # the rows did sample apart
    fast = ll.generate(shipped, [prompt], n=16, **knobs)
    assert shared[1].tolist() == [37 // PAGE] * 16
    assert fast.token_ids == want.token_ids
    np.testing.assert_allclose(np.asarray(fast.raw_logprobs), np.asarray(want.raw_logprobs),
                               atol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_n_rows_of_two_prompts_with_stop_strings(shipped):
    """Two prompts (one a whole number of pages), n = 3, stop strings, a processor that
    reads the prompt (NoRepeatNGram): as the rows prefilled one by one; `stream`'s text is
    `generate`'s."""
    prompts = [_prompt(1, 32), _prompt(2, 21)]
    knobs = dict(temperature=0.9, max_tokens=10, seed=[1, 2], stop=["e", "a"])
    procs = [ll.NoRepeatNGram.create(2, size=2)]
    got = ll.generate(shipped, prompts, n=3, processors=procs, **knobs)
    params = ll.SamplingParams.create(2, **knobs).samples(3)
    rows = [p for p in prompts for _ in range(3)]
    want = ll.generate(shipped, rows, params, processors=[ll.NoRepeatNGram.create(6, size=2)])
    _same(got, want, bits=False)
    assert got.text == want.text
    streamed = [""] * 6
    for event in ll.stream(shipped, prompts, n=3, processors=procs, chunk_steps=3, **knobs):
        streamed[event.row] += event.text
    assert streamed == got.text


# ----------------------------------------------------------------------------- generate_many


def _expected_prefill(rows: list[list[int]]) -> int:
    """Prefill tokens with a cache that evicts nothing: each row shares the full pages it
    has in common with an earlier row, but never its last token."""
    total = 0
    for i, ids in enumerate(rows):
        best = 0
        for other in rows[:i]:
            same = 0
            while same < min(len(ids), len(other)) and ids[same] == other[same]:
                same += 1
            best = max(best, same // PAGE)
        total += len(ids) - min(best, (len(ids) - 1) // PAGE) * PAGE
    return total


def _shared_prefix_job(count: int, prefix_len: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefix = _prompt(seed, prefix_len)
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.8, top_k=8),
    ]
    return [
        Request(
            prefix + rng.integers(3, 200, int(rng.integers(1, 20))).tolist(),
            dict(settings[i % 3], max_tokens=int(rng.integers(1, 8)), seed=i),
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("deterministic", [pytest.param(False, marks=pytest.mark.slow), True])
def test_prefix_cache_equals_no_cache(llama, deterministic):
    """6 requests of n = 2 rows sharing a 40-token prefix: the prefix cache (the default)
    against `prefix_cache=False` (contiguous slots); tokens equal, bit for bit under
    `deterministic=True`; the prefill computes only what no earlier row holds."""
    requests = _shared_prefix_job(6, 40, 0)
    bounds = dict(BOUNDS, n=2, deterministic=deterministic)
    want = generate_many(llama, requests, prefix_cache=False, **bounds)
    stats = {}
    got = generate_many(llama, requests, stats=stats, **bounds)
    for a, b in zip(got, want, strict=True):
        _same(a, b, bits=deterministic)
    rows = [r.prompt for r in requests for _ in range(2)]
    assert stats["prompt_tokens"] == sum(map(len, rows))
    assert stats["prefill_tokens"] == _expected_prefill(rows)
    assert stats["prefill_tokens"] + stats["cached_tokens"] == stats["prompt_tokens"]
    assert stats["prefill_tokens"] < stats["prompt_tokens"] // 3


def test_a_small_pool_evicts_and_keeps_results(llama):
    """The default pool of 20 pages for 4 slots cannot cache 16 requests' pages: cached
    pages are evicted (least recently used) to admit and grow rows, and the results stay
    those without a cache."""
    requests = _shared_prefix_job(16, 40, 1)
    want = generate_many(llama, requests, prefix_cache=False, **BOUNDS)
    stats = {}
    got = generate_many(llama, requests, kv_cache_tokens=POOL, stats=stats, **BOUNDS)
    assert stats["evicted_pages"] > 0
    assert stats["cached_tokens"] > 0
    for a, b in zip(got, want, strict=True):
        _same(a, b, bits=False)


@pytest.mark.slow
def test_structured_output_and_stop_strings_share_prefixes(shipped):
    """Requests with a regex, a choice, stop strings and processors behind a shared
    prefix: as without the cache."""
    prefix = "The list of answers to the questions below is long. " * 2
    requests = [
        Request(
            prefix + "Pick one:", dict(choice=["yes", "no"], seed=1, temperature=1.0, max_tokens=8)
        ),
        Request(prefix + "Digits:", dict(regex="[0-9]{3}", seed=2, temperature=1.0, max_tokens=8)),
        Request(prefix + "Say", dict(stop=["e"], seed=3, temperature=1.0, max_tokens=12)),
        Request(
            prefix + "Again",
            dict(seed=4, temperature=0.7, max_tokens=12),
            processors=[ll.NoRepeatNGram.create(1, size=2)],
        ),
    ]
    processors = [ll.NoRepeatNGram.create(1, size=0)]  # the job's, for the other requests
    bounds = dict(BOUNDS, processors=processors)
    want = generate_many(shipped, requests, prefix_cache=False, **bounds)
    stats = {}
    got = generate_many(shipped, requests, stats=stats, **bounds)
    assert stats["cached_tokens"] > 0
    for a, b in zip(got, want, strict=True):
        _same(a, b, bits=False)
        assert a.text == b.text


def test_prefix_cache_false_with_a_pool_shares_only_a_requests_rows(llama):
    requests = _shared_prefix_job(3, 40, 2)
    stats = {}
    # deterministic: the programs of `test_prefix_cache_equals_no_cache[True]` (same pool)
    generate_many(
        llama, requests, n=2, kv_cache_tokens=POOL, prefix_cache=False, stats=stats,
        deterministic=True, **BOUNDS,
    )  # fmt: skip
    first_rows = sum(len(r.prompt) for r in requests)
    second_rows = sum(len(r.prompt) - (len(r.prompt) - 1) // PAGE * PAGE for r in requests)
    assert stats["prefill_tokens"] == first_rows + second_rows


def test_bad_prefix_cache(shipped):
    with pytest.raises(ValueError, match="prefix_cache must be True, False or None"):
        generate_many(shipped, [[1, 2]], prefix_cache="yes")


# ----------------------------------------------------------------------------- speculation

SMALL = dict(slots=4, prefill_batch=2, chunk_steps=4, max_prompt_len=40, max_tokens_bound=16)


@pytest.fixture(scope="module")
def small():
    return small_llama(48, 64, 3)


def _draft(model) -> ll.DraftModel:
    """The model as its own draft (greedy rows accept every draft), never switched off."""
    return ll.DraftModel(model=model, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)


def test_a_draft_model_prefills_the_whole_prompt(small):
    """What kept speculation off shared pages: a prefill after cached pages computes only
    the rest of each prompt (`host.suffix_batch`), but a draft model's cache is its own.
    Its prefill (`decode_loop.speculation_state`) rebuilds the whole prompts
    (`PromptBatch.whole`): its cache is the whole batch's, bit for bit."""
    info = model_info(small)
    spec, draft_weights = speculative.resolve(_draft(small), info)
    program = Program(info.runner, speculative=spec)
    tables = Tables(info.weights, None, draft_weights=draft_weights)
    batch = prompt_batch([_prompt(1, 37, 48), _prompt(2, 20, 48)], 16, 64)
    cut = suffix_batch(batch, np.array([32, 16]))
    assert cut.prompt.shape == (2, 16)
    whole = jax.jit(PromptBatch.whole, static_argnums=1)(cut, 64)
    np.testing.assert_array_equal(whole[0], batch.prompt)
    np.testing.assert_array_equal(whole[1], batch.positions)
    state = jax.jit(speculation_state, static_argnums=(0, 3))
    want, got = state(program, tables, batch, 16), state(program, tables, cut, 16)
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_draft_model_on_shared_pages(small, deterministic):
    """Speculation's default is the pool with a prefix cache: 5 requests of n = 2 behind a
    24-token prefix, whose target prefill computes only the columns after the cached pages
    (16, under the prompt bucket of 64) while the draft model's own cache is prefilled
    with the whole prompt. Tokens and draft counts are those of `prefix_cache=False`
    (contiguous slots), and raw logprobs bit for bit under `deterministic=True`."""
    rng = np.random.default_rng(4)
    prefix = _prompt(4, 24, 48)
    requests = [
        Request(
            prefix + rng.integers(3, 48, int(rng.integers(1, 9))).tolist(),
            dict(temperature=0.0 if i % 2 else 0.9, max_tokens=int(rng.integers(6, 13)), seed=i),
        )
        for i in range(5)
    ]
    bounds = dict(SMALL, n=2, speculative=_draft(small), deterministic=deterministic)
    want = generate_many(small, requests, prefix_cache=False, **bounds)
    stats = {}
    got = generate_many(small, requests, stats=stats, **bounds)
    assert stats["cached_tokens"] >= 9 * 16  # every row but the first reads the prefix
    for a, b in zip(got, want, strict=True):
        _same(a, b, bits=deterministic)
        assert a.speculation == b.speculation
    assert sum(row["accepted"] for r in got for row in r.speculation) > 0


@pytest.mark.slow
def test_n_rows_with_speculation_equal_single_row_runs(small, monkeypatch):
    """`generate(..., n=3, speculative=...)` prefills each prompt once, the draft model's
    cache too (its rows repeated), and its rows are those of each prompt given 3 times."""
    forked = []
    start = generate_module._forked_state
    monkeypatch.setattr(generate_module, "_forked_state", lambda *a: forked.append(1) or start(*a))
    prompts = [(_prompt(5, 3, 48) * 8)[:21], _prompt(6, 17, 48)]
    knobs = dict(temperature=[0.0, 0.9], max_tokens=8, seed=[7, 8])
    got = ll.generate(small, prompts, n=3, speculative=_draft(small), ignore_eos=True, **knobs)
    assert forked == [1]
    rows = ll.SamplingParams.create(2, **knobs).samples(3)
    repeated = [p for p in prompts for _ in range(3)]
    want = ll.generate(small, repeated, rows, speculative=_draft(small), ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert got.speculation == want.speculation


def test_page_keys_chain_the_tokens_before():
    a = page_keys([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # full pages only
    assert page_keys([1, 2, 3, 4], 2) == a
    assert page_keys([9, 2, 3, 4], 2)[1] != a[1]  # same page, another page before it
    cache = PrefixCache()
    cache.add(a[0], 5)
    cache.add(a[1], 6)
    assert cache.match(a, 2) == [5, 6] and cache.match(a, 1) == [5]
    cache.acquire([5, 6])
    assert cache.release([5, 6]) == [6, 5]  # deeper pages go idle (and are evicted) first
    assert cache.evict(1, keep=set()) == [6]
    assert cache.match(a, 2) == [5]


@pytest.mark.slow
def test_64_requests_with_a_1k_prefix_bit_for_bit(shipped):
    """The issue's job: 64 requests sharing a ~1K-token prefix (960 tokens: the shipped
    model's context is 1024), bit for bit under `deterministic=True` against
    `prefix_cache=False`."""
    requests = _shared_prefix_job(64, 960, 3)
    bounds = dict(slots=16, deterministic=True)
    want = generate_many(shipped, requests, prefix_cache=False, **bounds)
    stats = {}
    got = generate_many(shipped, requests, stats=stats, **bounds)
    for a, b in zip(got, want, strict=True):
        _same(a, b, bits=True)
    assert stats["prefill_tokens"] == _expected_prefill([r.prompt for r in requests])
