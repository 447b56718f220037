"""A user's own model through the attention contract (issue 65, `logitloop.models.kv`): the
tests' decoder written as plain JAX functions (`tests/models/user_model.py`, not
`logitloop.models`), random weights, run through every entry point. Its attention goes
through `ll.attention`, so the library's cache serves it: a paged pool with the prefix
cache gives contiguous decoding's tokens, `n = 4` rows on shared prefix pages are four
separate rows bit for bit under `deterministic=True`, speculation is plain decoding (`-m
slow`), and its scores are its own full forward's (`kv=None`; `ll.check_model` compares
that forward with the contiguous and paged caches logit by logit,
`tests/models/test_check_model.py`). A family goes through the same contract: a Llama as a
`FunctionModel` is the family itself, bit for bit. The tiny sizes keep each program's
compile short: this file runs in the default suite."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from tests.decoding.random_llama import small_llama
from tests.models import user_model
from tests.models.user_model import SPEC, V, apply_fn, init_params


@pytest.fixture(scope="module")
def model():
    return user_model.model()


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, n).tolist() for n in lengths]


def test_paged_pool_with_prefix_cache_equals_contiguous_generate(model):
    """generate_many on a paged pool of pages of 8, the prefix cache sharing a common
    16-token prefix between requests, against generate on the contiguous cache: the same
    tokens, greedy and sampled. (The full forward against the contiguous and the paged
    cache, logit by logit: `ll.check_model` of this model, tests/models/test_check_model.py.)"""
    ps = prompts([5, 19, 3, 21])
    ps[3][:16] = ps[1][:16]  # two full pages in common: the prefix cache shares them
    for knobs in (
        dict(temperature=0.0, max_tokens=8),
        dict(temperature=0.9, top_p=0.95, max_tokens=8, seed=[3, 4, 5, 6]),
    ):
        want = ll.generate(model, ps, **knobs)
        requests = [
            ll.Request(p, {k: (v[i] if isinstance(v, list) else v) for k, v in knobs.items()})
            for i, p in enumerate(ps)
        ]
        stats = {}
        got = ll.generate_many(
            model, requests, slots=2, chunk_steps=4, max_prompt_len=32, max_tokens_bound=8,
            kv_cache_tokens=128, page_size=8, stats=stats,
        )  # fmt: skip
        assert [r.token_ids[0] for r in got] == want.token_ids
        assert stats["cached_tokens"] >= 16


def test_n_rows_share_pages_and_equal_separate_rows(model):
    """n = 4 (the prompt prefilled once, its rows on its pages) against the prompt given
    four times with the same rows' seeds (`SamplingParams.samples`), each row its own
    prefill in the contiguous cache: bit for bit under deterministic=True (a row beside
    others is the row alone, next test). 37 tokens: two full pages of 16, shared, and a
    partial one, copied (the shipped model's twin of this test,
    `tests/batching/test_prefix_cache.py`, is `-m slow`)."""
    p = prompts([37], seed=2)[0]
    knobs = dict(temperature=1.0, max_tokens=6, seed=11, logprobs=1)
    rows = ll.SamplingParams.create(1, **knobs).samples(4)
    forked = ll.generate(model, [p], n=4, ignore_eos=True, deterministic=True, **knobs)
    separate = ll.generate(model, [p] * 4, rows, ignore_eos=True, deterministic=True)
    assert forked.token_ids == separate.token_ids
    assert forked.raw_logprobs == separate.raw_logprobs
    assert len(set(map(tuple, forked.token_ids))) > 1  # the rows sampled apart


@pytest.mark.slow  # the n = 4 test above pins the same bits across layouts
def test_deterministic_rows_keep_their_bits_whatever_the_batch(model):
    """deterministic=True: a row alone and the same row beside others (and as one of n = 4
    rows on shared pages) give the same tokens and logprob bits."""
    ps = prompts([7, 13, 4, 9])
    knobs = dict(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=1)
    batch = ll.generate(model, ps, seed=[1, 2, 3, 4], deterministic=True, **knobs)
    alone = ll.generate(model, ps[1:2], seed=2, deterministic=True, **knobs)
    assert batch.token_ids[1] == alone.token_ids[0]
    assert batch.raw_logprobs[1] == alone.raw_logprobs[0]


@pytest.mark.slow  # verification is `forward_columns`, which scoring runs by default
def test_speculative_equals_plain(model):
    """Prompt lookup (strict) verifies drafts in one T = k + 1 call: the same tokens."""
    p = prompts([6], seed=4)[0] * 3
    plain = ll.generate(model, [p, p[:9]], temperature=0.0, max_tokens=10)
    lookup = ll.PromptLookup(max_ngram=3, num_draft=3, cycle_cost=1.0)
    spec = ll.generate(model, [p, p[:9]], temperature=0.0, max_tokens=10, speculative=lookup)
    assert spec.token_ids == plain.token_ids


def test_scores_equal_the_models_own_full_forward(model):
    ps, conts = prompts([5, 9], seed=5), prompts([4, 2], seed=6)
    got = ll.score(model, ps, conts)
    for prompt, cont, r in zip(ps, conts, got, strict=True):
        seq = np.asarray(prompt + cont, np.int32)[None]
        logits, _ = apply_fn(model.params, seq, np.arange(seq.shape[1], dtype=np.int32)[None], None)
        z = np.asarray(logits[0], np.float64)
        m = z.max(-1, keepdims=True)
        logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))  # float64 log-softmax
        want = [logp[len(prompt) - 1 + j, t] for j, t in enumerate(cont)]
        np.testing.assert_allclose(r.raw_logprobs, want, atol=2e-5)


class NNXDecoder(nnx.Module):
    """The same model as an NNX module (weights as nnx.Param state) for `ll.from_nnx`."""

    def __init__(self, params):
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, tokens, positions, kv):
        return apply_fn(jax.tree.map(lambda p: p[...], self.params), tokens, positions, kv)


def test_nnx_module_weights_update_without_compiling(model, compile_counter):
    """from_nnx reads the module's state at each call: `nnx.update` with new weights gives
    the new model's tokens and compiles nothing."""
    module = NNXDecoder(init_params(0))
    wrapped = ll.from_nnx(module, SPEC, vocab_size=V, max_length=128)
    ps = prompts([5, 8])
    first = ll.generate(wrapped, ps, temperature=0.0, max_tokens=6)
    assert first.token_ids == ll.generate(model, ps, temperature=0.0, max_tokens=6).token_ids
    other = NNXDecoder(init_params(1))
    nnx.update(module, nnx.state(other))
    with compile_counter as c:
        second = ll.generate(wrapped, ps, temperature=0.0, max_tokens=6)
    assert c.count == 0
    ref = user_model.model(init_params(1))
    assert second.token_ids == ll.generate(ref, ps, temperature=0.0, max_tokens=6).token_ids
    assert second.token_ids != first.token_ids


def test_linen_module_is_the_function_model(model):
    linen = pytest.importorskip("flax.linen")

    class LinenDecoder(linen.Module):
        @linen.compact
        def __call__(self, tokens, positions, kv):
            params = self.param("w", lambda _: init_params(0))
            return apply_fn(params, tokens, positions, kv)

    module = LinenDecoder()
    variables = {"params": {"w": init_params(0)}}
    wrapped = ll.from_linen(module, variables, SPEC, vocab_size=V, max_length=128)
    ps, conts = prompts([5, 8]), prompts([3, 3], seed=1)
    got, want = ll.score(wrapped, ps, conts), ll.score(model, ps, conts)
    assert [r.raw_logprobs for r in got] == [r.raw_logprobs for r in want]


def test_a_family_through_the_public_contract_is_itself_bit_for_bit():
    """A Llama family's module called as a user's FunctionModel (its blocks call
    ll.attention, as any model's) gives the family's own tokens and logprob bits."""
    llama = small_llama(V, 64, 0)
    graphdef, state = nnx.split(llama)

    def family(weights, tokens, positions, kv):  # the last column's logits, [B, V]
        return nnx.merge(graphdef, weights)(tokens, positions, kv)

    c = llama.config
    wrapped = ll.FunctionModel(
        family, state, kv_spec=llama.kv_spec, vocab_size=c.vocab_size, max_length=64
    )
    knobs = dict(temperature=0.8, max_tokens=6, seed=[1, 2], logprobs=1, ignore_eos=True)
    ps = prompts([6, 9], seed=7)
    want = ll.generate(llama, ps, **knobs)
    got = ll.generate(wrapped, ps, **knobs)
    assert got.token_ids == want.token_ids
    assert got.raw_logprobs == want.raw_logprobs


def test_stream_beam_search_token_logprobs_and_precompile_take_it(model, compile_counter):
    """The other entry points: `stream` gives `generate`'s tokens; beam search with one
    beam is greedy; `token_logprobs` gives `score`'s; after `precompile` at the call's
    buckets `generate` compiles nothing."""
    ps = prompts([6, 10], seed=8)
    greedy = ll.generate(model, ps, temperature=0.0, max_tokens=5, ignore_eos=True)
    streamed = [[], []]
    for event in ll.stream(model, ps, temperature=0.0, max_tokens=5, ignore_eos=True):
        streamed[event.row] += event.token_ids
    assert streamed == greedy.token_ids
    beams = ll.beam_search(model, ps, num_beams=1, max_tokens=5, ignore_eos=True)
    assert [b[0].token_ids for b in beams] == greedy.token_ids
    rows = [p + g for p, g in zip(ps, greedy.token_ids, strict=True)]
    width = max(map(len, rows))
    ids = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32)
    lengths = [len(r) for r in rows]
    got = ll.token_logprobs(model, ids, [6, 10], lengths=lengths, deterministic=False)
    scored = ll.score(model, ps, greedy.token_ids)
    for row, p, s in zip(np.asarray(got.raw_logprobs), ps, scored, strict=True):
        np.testing.assert_allclose(row[len(p) : len(p) + 5], s.raw_logprobs, atol=2e-5)
    # Rows 3 (bucket 4): programs no earlier call of the module compiled.
    report = ll.precompile(model, rows=3, prompt_len=12, max_tokens=7, temperature=0.5)
    assert report.programs > 0
    with compile_counter as c:
        ll.generate(model, prompts([3, 12, 7], seed=9), temperature=0.5, max_tokens=7, seed=1)
    assert c.count == 0
