"""A model whose layers' windows differ (Gemma 2: local and global layers) on
`generate_many`'s pool: one page table and one pool of pages per layer group
(`pool.shape_for`), so a local layer's pages behind its window go back to its group while
the global layers keep theirs; the tokens are those of the contiguous job."""

from __future__ import annotations

import numpy as np
import pytest

from logitloop.decoding.engine.batching import Request, generate_many
from logitloop.decoding.loop import pool
from logitloop.models import layers
from tests.decoding.random_llama import small_gemma

V = 48
PAGE = 4
WINDOW = 4  # the local layer's; the other layer is global
BOUNDS = dict(chunk_steps=4, prefill_batch=2, max_prompt_len=8, max_tokens_bound=16)


@pytest.fixture(scope="module")
def gemma():
    return small_gemma(V, 64, 3, sliding_windows=(WINDOW, None))


def _requests() -> list[Request]:
    """Two rows of 19 and 23 tokens (prompts of 3 and 7, 16 new tokens each), one greedy,
    one sampled."""
    rng = np.random.default_rng(5)
    return [
        Request([int(t) for t in rng.integers(0, V, 3 + 4 * i)], dict(
            temperature=0.9 * i, max_tokens=16, seed=i
        ))
        for i in range(2)
    ]  # fmt: skip


def test_shape_for_groups_layers_by_window():
    """The main group serves the global layers (or the longest window); a shorter window
    gets its own group, sized by its window, never over the main group's pages."""
    shape = pool.shape_for((4, None, 4, 8), 100, 4, 10, rows=3)
    assert (shape.window, shape.layer_groups) == (None, (2, 0, 2, 1))
    assert shape.groups == ((8, 3 * 3 + 10), (4, 3 * 2 + 10))
    assert shape.layer_pages() == (16, 100, 16, 19)
    assert pool.shape_for((4, 8), 12, 4, 10, rows=3) == pool.PoolShape(
        12, 4, 10, 8, ((4, 12),), (1, 0)
    )
    assert pool.shape_for((None, None), 100, 4, 10, 3) == pool.PoolShape(100, 4, 10)


def test_local_pages_return_while_global_pages_stay(gemma):
    """Two rows in a pool of 8 pages of 4 tokens (the global layer's: the rows need 11,
    so one is preempted and resumed): at every chunk's end the local group holds at most
    the pages its window spans, 2 a row, while the global group holds every page written;
    the tokens are those of the contiguous job, logprobs within float32 rounding."""
    reqs = _requests()
    want = generate_many(gemma, reqs, slots=2, **BOUNDS)
    stats = {}
    got = generate_many(
        gemma, reqs, slots=2, kv_cache_tokens=32, page_size=PAGE, stats=stats, **BOUNDS
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, rtol=1e-4, atol=1e-4)
    assert stats["preemptions"] > 0
    held_global, held_local = stats["most_pages_held"]
    assert held_local <= 2 * (-(-WINDOW // PAGE) + 1) < held_global


@pytest.mark.slow
def test_deterministic_grouped_job_is_the_contiguous_job_bit_for_bit(gemma, monkeypatch):
    """`deterministic=True`, rows preempted and resumed: raw logprobs bit for bit those of
    the contiguous job whose local layer keeps the full layout (a ring, the contiguous
    cache's default for a short window, sums its keys in another order)."""
    monkeypatch.setattr(layers, "RING_SLACK", 10**6)  # no ring: the full layout's masks
    reqs = _requests()
    kwargs = dict(deterministic=True, **BOUNDS)
    want = generate_many(gemma, reqs, slots=2, **kwargs)
    stats = {}
    got = generate_many(
        gemma, reqs, slots=2, kv_cache_tokens=32, page_size=PAGE, stats=stats, **kwargs
    )
    assert stats["preemptions"] > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.raw_logprobs for r in got] == [r.raw_logprobs for r in want]


def test_a_mixed_window_model_has_no_prefix_cache(gemma):
    """The prefix cache shares one page table's pages: asked for with layer groups, it is
    refused before any work, naming why."""
    with pytest.raises(ValueError, match="prefix_cache=True: .* layers of different windows"):
        generate_many(gemma, _requests(), slots=2, prefix_cache=True, **BOUNDS)


@pytest.mark.slow
def test_speculative_grouped_job_equals_the_contiguous_one(gemma):
    """Prompt lookup on the grouped pool: a verification takes its drafts' pages in every
    group (`pool.grow_drafts`), and the tokens are the contiguous speculative job's."""
    import logitloop as ll

    spec = ll.PromptLookup(max_ngram=2, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)
    reqs = [
        Request([5, 9, 5, 9, 5, 9, 5][: 4 + i], dict(temperature=0.0, max_tokens=16))
        for i in range(2)
    ]
    want = generate_many(gemma, reqs, slots=2, speculative=spec, **BOUNDS)
    stats = {}
    got = generate_many(
        gemma, reqs, slots=2, speculative=spec, kv_cache_tokens=32, page_size=PAGE,
        stats=stats, **BOUNDS,
    )  # fmt: skip
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(row["drafted"] for r in got for row in r.speculation) > 0
    held_global, held_local = stats["most_pages_held"]
    assert held_local < held_global
