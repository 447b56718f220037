"""`generate_many(..., kv_cache_tokens=N)`: the slots share one paged pool, and every
request gets the tokens it gets from `generate_many` without pages (float32, a small
random Llama), with rows admitted by free pages, pages freed as rows finish, and rows
preempted and resumed when the pool runs dry."""

from __future__ import annotations

import numpy as np
import pytest

from logitloop.decoding.engine import paged_batching
from logitloop.decoding.engine.batching import Request, generate_many
from logitloop.decoding.loop import pages
from tests.decoding.random_llama import small_llama
from tests.decoding.scripted import ByteTokenizer

V = 48
PAGE = 4
BOUNDS = dict(chunk_steps=4, prefill_batch=2, max_prompt_len=15, max_tokens_bound=24)


@pytest.fixture(scope="module")
def model():
    m = small_llama(V, 64, 3)
    m.tokenizer = ByteTokenizer([bytes([97 + i % 26]) for i in range(V)])
    return m


def _requests(count: int, seed: int) -> list[Request]:
    """Mixed prompt (1-15) and output (1-24) lengths, per-row settings, a stop string, n=2
    rows per request (seeded, so the two rows differ)."""
    rng = np.random.default_rng(seed)
    # The stop string comes first: the job's first admission then fixes every width, and
    # each job compiles its programs once.
    settings = [
        dict(temperature=1.0, stop=["e"]),
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=8, presence_penalty=0.5),
    ]
    out = []
    for i in range(count):
        prompt = [int(t) for t in rng.integers(0, V, int(rng.integers(1, 16)))]
        knobs = dict(settings[i % len(settings)], max_tokens=int(rng.integers(1, 25)), seed=i)
        out.append(Request(prompt, knobs, id=f"r{i}"))
    return out


def _tokens(results):
    return [(r.token_ids, r.finish_reason, r.text) for r in results]


@pytest.fixture(scope="module")
def job(model):
    """12 requests of 2 rows, half of them behind a common 8-token prefix: without pages
    (4 contiguous slots of 40 tokens each), and with a pool of 64 tokens for 8 slots and
    its prefix cache, the default (16 pages: rows must wait for pages, and the rows
    running hold the cached pages, so eviction cannot help and rows are preempted)."""
    reqs = _requests(12, 0)
    prefix = [int(t) for t in np.random.default_rng(1).integers(0, V, 2 * PAGE)]
    reqs[::2] = [Request((prefix + r.prompt)[:15], r.params, r.id) for r in reqs[::2]]
    want = generate_many(model, reqs, slots=4, n=2, prefix_cache=False, **BOUNDS)
    stats = {}
    got = generate_many(
        model, reqs, slots=8, n=2, kv_cache_tokens=64, page_size=PAGE, stats=stats, **BOUNDS
    )
    return want, got, stats


def test_paged_job_equals_the_contiguous_job(job):
    want, got, _ = job
    assert _tokens(got) == _tokens(want)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.raw_logprobs, b.raw_logprobs, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_a_small_pool_preempts_and_resumes(job):
    """Preemption together with the prefix cache: rows share cached pages (a request's two
    rows, the common prefix), and a preempted row reads its prompt's cached pages when it
    resumes instead of recomputing them."""
    _, _, stats = job
    assert stats["preemptions"] > 0
    assert stats["resumed"] == stats["preemptions"]
    assert stats["cached_tokens"] > 0
    assert stats["resume_cached_tokens"] > 0
    # 16 pages of 4 tokens: never more rows than pages, whatever the 8 slots allow
    assert 1 <= stats["most_rows_in_flight"] <= 8


def test_pages_return_to_the_pool(model):
    """After a job every page is free again (finished rows free theirs on device)."""
    reqs = _requests(3, 1)
    batcher = paged_batching.batcher(
        _plan(model),
        reqs,
        64,
        PAGE,
        {},
        slots=8,
        defaults={},
        chunk_steps=4,
        prefill_batch=2,
        max_prompt_len=15,
        max_tokens=24,  # the batcher's own name for the bound
    )
    results = list(batcher.run(reqs))
    assert len(results) == 3
    state = batcher.state.pages.pages
    assert int(pages.free_pages(state)) == 16
    assert np.all(np.asarray(state.tables) == pages.NO_PAGE)


def _plan(model):
    from logitloop.decoding.engine.plan import Options, plan

    return plan(model, Options.of("iter_generate_many", {}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kv_cache_tokens=64, page_size=3), "page_size = 3 must be a positive power of two"),
        (dict(kv_cache_tokens=64, page_size=0), "page_size = 0 must be a positive power"),
        (dict(kv_cache_tokens=2, page_size=4), "kv_cache_tokens = 2 is under one page"),
        (
            dict(kv_cache_tokens=16, page_size=4),
            r"requests\[1\] \(id 'long'\) needs 28 tokens of KV cache .* over kv_cache_tokens = 16",
        ),
    ],
)
def test_bad_pool(model, kwargs, match):
    reqs = [Request([1, 2], dict(max_tokens=3)), Request([1] * 10, dict(max_tokens=17), "long")]
    with pytest.raises(ValueError, match=match):
        generate_many(model, reqs, slots=2, **kwargs)


def test_a_pool_on_a_mesh_splits_into_whole_pages_per_data_shard(model):
    """On a mesh with a data axis of 2, `kv_cache_tokens` is two pools' worth, each of
    whole pages, and a request must fit one of them (its rows take pages of one shard)."""

    with pytest.raises(
        ValueError,
        match=r"kv_cache_tokens = 100 does not split into the mesh's data axis of 2 shards "
        r"\(one pool each\) in whole pages of page_size = 16: give a multiple of 32 "
        r"\(e.g. 96 or 128\)",
    ):
        paged_batching.check_pool(100, 16, shards=2)
    assert paged_batching.check_pool(96, 16, shards=2) == (6, 16)
    reqs = [Request([1, 2], dict(max_tokens=3)), Request([1] * 10, dict(max_tokens=17), "long")]
    paged_batching.check_requests(_plan(model).info, reqs, {}, 48, 4)  # fits the whole pool
    with pytest.raises(
        ValueError,
        match=r"requests\[1\] \(id 'long'\) needs 28 tokens .* over kv_cache_tokens = 48 / 2 "
        r"data shards",
    ):
        paged_batching.check_requests(_plan(model).info, reqs, {}, 48, 4, shards=2)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_tokens", [1024, 64])
def test_deterministic_paged_job(model, kv_cache_tokens):
    """`deterministic=True`: tokens equal and raw logprobs bit for bit, with no row
    preempted (a pool of 1024 tokens) and with rows preempted and resumed (64 tokens: a
    resumed row's prompt goes through a prompt pass and its generated tokens through a
    decode-kind pass, as they did the first time, `pool.resume`)."""
    reqs = _requests(12, 2)
    want = generate_many(model, reqs, slots=4, n=2, deterministic=True, **BOUNDS)
    stats = {}
    got = generate_many(
        model, reqs, slots=8, n=2, deterministic=True, kv_cache_tokens=kv_cache_tokens,
        page_size=PAGE, stats=stats, **BOUNDS,
    )  # fmt: skip
    assert _tokens(got) == _tokens(want)
    assert (stats["preemptions"] == 0) == (kv_cache_tokens == 1024)
    assert [a.raw_logprobs for a in got] == [b.raw_logprobs for b in want]


def test_speculative_paged_job_equals_the_contiguous_one(model):
    """Prompt lookup (strict) on the pool: each verification first takes the pages of the
    drafts it writes, a rollback keeps them (the next cycle rewrites their slots), and a
    small pool refuses drafts or preempts; the tokens are those of the same speculative job
    without pages."""
    import logitloop as ll

    spec = ll.PromptLookup(max_ngram=2, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(6):
        period = [int(t) for t in rng.integers(0, V, int(rng.integers(2, 5)))]
        knobs = dict(temperature=0.0 if i % 2 else 0.9, max_tokens=int(rng.integers(8, 25)))
        reqs.append(Request((period * 5)[: int(rng.integers(6, 16))], dict(knobs, seed=i)))
    want = generate_many(model, reqs, slots=3, speculative=spec, prefix_cache=False, **BOUNDS)
    stats = {}
    got = generate_many(
        model, reqs, slots=6, speculative=spec, kv_cache_tokens=48, page_size=PAGE,
        stats=stats, **BOUNDS,
    )  # fmt: skip
    assert _tokens(got) == _tokens(want)
    assert sum(row["drafted"] for r in got for row in r.speculation) > 0
    assert sum(row["accepted"] for r in got for row in r.speculation) > 0
    assert stats["preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_64_requests_paged_equal_contiguous(model, deterministic):
    """The issue's job: 64 requests of 2 rows (prompts of 1-15 tokens, outputs of 1-24,
    three kinds of settings, a stop string), contiguous against a pool that holds every
    row (no preemption) and one of 64 tokens (rows preempted and resumed): tokens equal,
    and under `deterministic=True` raw logprobs bit for bit."""
    reqs = _requests(64, 4)
    kwargs = dict(n=2, deterministic=deterministic, **BOUNDS)
    want = generate_many(model, reqs, slots=8, **kwargs)
    for tokens, preempted in ((2048, False), (64, True)):
        stats = {}
        got = generate_many(
            model, reqs, slots=16, kv_cache_tokens=tokens, page_size=PAGE, stats=stats, **kwargs
        )
        assert _tokens(got) == _tokens(want)
        assert (stats["preemptions"] > 0) == preempted, stats
        if deterministic:
            assert [a.raw_logprobs for a in got] == [b.raw_logprobs for b in want]
        else:
            for a, b in zip(got, want, strict=True):
                for x, y in zip(a.raw_logprobs, b.raw_logprobs, strict=True):
                    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_a_job_holds_its_pool_and_the_weights():
    """The device bytes a job adds while it runs (the sum of `jax.live_arrays()` sizes,
    sampled as each request completes, less what was live before: the job's copy of the
    weights, the pool, the slots' other state) stay within 1.2x of N tokens of KV plus the
    weights, however many slots share the pool (a Llama whose KV, 2 kB a token, outweighs
    the slots' token and logprob buffers)."""
    import jax
    from flax import nnx

    from logitloop.decoding.engine.batching import iter_generate_many
    from logitloop.models import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=4, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    llama = LlamaModel(config, rngs=nnx.Rngs(0))
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(llama)))
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    tokens = 128

    def live() -> int:
        return sum(x.nbytes for x in jax.live_arrays())

    reqs = [Request([i % V] * (1 + i % 7), dict(max_tokens=4 + i % 13)) for i in range(16)]
    before, held = live(), 0
    for _ in iter_generate_many(
        llama, reqs, slots=8, kv_cache_tokens=tokens, page_size=PAGE, chunk_steps=4,
        max_prompt_len=8, max_tokens_bound=16,
    ):  # fmt: skip
        held = max(held, live() - before)
    bound = tokens * kv_per_token + weights
    assert 0 < held <= 1.2 * bound, (held, bound)


@pytest.mark.slow  # `release_before` itself: tests/decoding/test_pages.py
def test_a_sliding_window_returns_the_pages_behind_it():
    """Every layer with a window of 4 tokens: a decode step first returns the pages wholly
    behind the window (`pool.grow`), so 4 greedy rows of 25-30 tokens run in a pool of 16
    pages of 4 with no preemption (holding every page they wrote, each would hold 7-8 and
    the pool would run dry), and take the tokens of the contiguous job."""
    windowed = small_llama(V, 64, 3, sliding_windows=(4, 4))
    rng = np.random.default_rng(5)
    reqs = [
        Request([int(t) for t in rng.integers(0, V, 2 + i)], dict(temperature=0.0, max_tokens=24))
        for i in range(4)
    ]
    bounds = dict(chunk_steps=4, prefill_batch=2, max_prompt_len=8, max_tokens_bound=24)
    want = generate_many(windowed, reqs, slots=4, **bounds)
    stats = {}
    got = generate_many(
        windowed, reqs, slots=4, kv_cache_tokens=64, page_size=PAGE, stats=stats, **bounds
    )
    assert _tokens(got) == _tokens(want)
    assert stats["preemptions"] == 0


@pytest.mark.slow
def test_draft_model_paged_job_equals_the_contiguous_one(model):
    """A draft model (the target itself, so greedy rows accept every draft) on the pool:
    its own cache stays a contiguous one per slot, parked rows propose nothing, and the
    tokens are the contiguous speculative job's."""
    import logitloop as ll

    spec = ll.DraftModel(model=model, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)
    reqs = _requests(8, 6)
    want = generate_many(model, reqs, slots=4, n=2, speculative=spec, prefix_cache=False, **BOUNDS)
    stats = {}
    got = generate_many(
        model, reqs, slots=8, n=2, speculative=spec, kv_cache_tokens=48, page_size=PAGE,
        stats=stats, **BOUNDS,
    )  # fmt: skip
    assert _tokens(got) == _tokens(want)
    assert sum(row["accepted"] for r in got for row in r.speculation) > 0
    assert stats["preemptions"] > 0
