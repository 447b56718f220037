"""`SamplingParams.create` without a batch_size: one row that every entry point repeats to its
batch, with the same results as the same knobs given per batch (or as keywords)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine.explain import explain_next_token

V = 40
KNOBS = dict(temperature=0.8, top_p=0.95, seed=7)


def _apply(table, tokens, positions, cache):
    """Logits of every column ([B, T, V]: `score` reads them all) from the token and its
    position; no cache."""
    return table[tokens, jnp.maximum(positions, 0)], cache


def _no_cache(batch, length):
    return jnp.zeros((batch,), jnp.int32)


@pytest.fixture(scope="module")
def model():
    table = np.random.default_rng(5).normal(0, 2.0, (V, 64, V)).astype(np.float32)
    return ll.FunctionModel(_apply, jnp.asarray(table), _no_cache, V, 64)


def test_create_without_batch_size_is_one_row_that_broadcasts():
    params = ll.SamplingParams.create(temperature=0.8, top_p=0.95, max_new_tokens=9)
    assert params.batch_size == 1 and params.broadcasts
    assert int(params.max_tokens[0]) == 9  # transformers' name, here too
    wide = params.broadcast_to(3)
    assert wide.batch_size == 3 and not wide.broadcasts
    np.testing.assert_array_equal(wide.top_p, np.full(3, 0.95, np.float32))
    assert not ll.SamplingParams.create(1).broadcasts  # an explicit batch stays as it is
    with pytest.raises(ValueError, match="params has batch_size 1 but there are 3 prompts"):
        ll.SamplingParams.create(1).broadcast_to(3)


def test_sample_broadcasts():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, V)), jnp.float32)
    positions = jnp.arange(4)
    one = ll.SamplingParams.create(**KNOBS)
    each = ll.SamplingParams.create(4, **KNOBS)
    np.testing.assert_array_equal(
        ll.sample(logits, one, positions).tokens, ll.sample(logits, each, positions).tokens
    )
    with pytest.raises(ValueError, match="params has batch_size 2 but logits have 4 rows"):
        ll.sample(logits, ll.SamplingParams.create(2), positions)


PROMPTS = [[1], [2, 3], [4]]


def test_generate_and_stream_broadcast(model):
    one = ll.SamplingParams.create(max_tokens=6, **KNOBS)
    want = ll.generate(model, PROMPTS, max_tokens=6, **KNOBS)  # keywords: one row per prompt
    got = ll.generate(model, PROMPTS, one)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    streamed = [[] for _ in PROMPTS]
    for event in ll.stream(model, PROMPTS, one):
        streamed[event.row].extend(event.token_ids)
    assert streamed == want.token_ids
    with pytest.raises(ValueError, match="params has batch_size 2 but there are 3 prompts"):
        ll.generate(model, PROMPTS, ll.SamplingParams.create(2, **KNOBS))


@pytest.mark.slow
def test_score_beam_explain_and_generate_many_broadcast(model):
    """Slow (about 20 s: a program each); the default suite runs each entry point's
    broadcast through its own tests (`test_explain`, `test_chat`, `test_generate_many`)."""
    prompts = PROMPTS
    one = ll.SamplingParams.create(max_tokens=6, **KNOBS)
    want = ll.generate(model, prompts, one)

    conts = [[5, 6], [7], [8, 9]]
    each = ll.SamplingParams.create(3, **KNOBS)
    by_row = [r.logprobs for r in ll.score(model, prompts, conts, each)]
    assert [r.logprobs for r in ll.score(model, prompts, conts, one)] == by_row

    greedy = ll.SamplingParams.create(max_tokens=4)
    beams = ll.beam_search(model, prompts, num_beams=2, max_tokens=4, params=greedy)
    assert len(beams) == 3
    assert [b[0].token_ids for b in beams] == [
        b[0].token_ids for b in ll.beam_search(model, prompts, num_beams=2, max_tokens=4)
    ]
    assert explain_next_token(model, [1], one).sampled_token == want.token_ids[0][0]
    got = ll.generate_many(model, [ll.Request(p, one) for p in prompts], slots=2)
    assert [r.token_ids[0] for r in got] == want.token_ids


def _top_reference(logits: np.ndarray, n: int) -> list[int]:
    """The n best ids of one row by float64 log-softmax, ties to the lower id."""
    x = logits.astype(np.float64)
    return np.argsort(-(x - np.log(np.exp(x - x.max()).sum())), kind="stable")[:n].tolist()


def test_top_logprobs_exactly_as_wide_as_the_widest_row():
    rng = np.random.default_rng()
    logits = rng.normal(size=(2, V)).astype(np.float32)
    positions = jnp.zeros(2, jnp.int32)
    out = ll.sample(jnp.asarray(logits), ll.SamplingParams.create(2, logprobs=5), positions)
    assert out.top_logprobs.ids.shape == out.top_logprobs.values.shape == (2, 5)
    for r in range(2):  # every column a real alternative: no padding
        assert np.asarray(out.top_logprobs.ids[r]).tolist() == _top_reference(logits[r], 5)
    one = ll.SamplingParams.create(logprobs=0)  # one row that broadcasts: none asked
    assert ll.sample(jnp.asarray(logits), one, positions).top_logprobs.ids.shape == (2, 0)

    params = ll.SamplingParams.create(2, logprobs=[3, 7])
    assert params.top_logprobs_width == 7
    assert params.replace(logprobs=np.asarray([1, 2], np.int32)).top_logprobs_width == 2
    assert params.take([0]).top_logprobs_width == 7  # a subset keeps its compiled width
    both = ll.SamplingParams.concat([params, ll.SamplingParams.create(1, logprobs=9)])
    assert both.top_logprobs_width == 9 and both.widths().top_logprobs == 9
    with pytest.raises(ValueError, match="row 1 asks for logprobs = 7, over width 4"):
        params.widen(dataclasses.replace(params.widths(), top_logprobs=4))
