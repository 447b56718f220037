"""The decode loop against a scripted fake model: exact token sequences, no randomness."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine import generate as gen
from logitloop.decoding.engine.plan import plan

from .scripted import expected, make_model

V = 40


@pytest.fixture
def table():
    return np.random.default_rng(1234).integers(0, V, size=(V, 256))


def _run(model, prompts, **knobs):
    params = ll.SamplingParams.create(batch_size=len(prompts), temperature=0.0, **knobs)
    return ll.generate(model, prompts, params)


def test_rows_end_at_different_steps_with_eos(table):
    eos = 7
    model = make_model(table, eos=(eos,))
    prompts = [list(np.random.default_rng(i).integers(0, V, size=1 + i)) for i in range(6)]
    max_tokens = [3, 9, 17, 30, 40, 50]
    res = _run(model, prompts, max_tokens=max_tokens)
    for i, p in enumerate(prompts):
        want, reason = expected(table, p, max_tokens[i], stop_ids=(eos,))
        assert res.token_ids[i] == want
        assert res.finish_reason[i] == reason
        assert res.num_tokens[i] == len(want)
        if reason == "stop":
            assert res.stop_reason[i] == eos
    assert len(set(res.num_tokens)) > 2  # the rows really ended at different steps


def test_ignore_eos_runs_to_length(table):
    model = make_model(table, eos=tuple(range(V)))  # every token is EOS
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=6)
    res = ll.generate(model, [[3]], params, ignore_eos=True)
    assert res.token_ids[0] == expected(table, [3], 6)[0]
    assert res.finish_reason == ["length"]
    assert ll.generate(model, [[3]], params).num_tokens == [1]


def test_several_stop_ids_per_row(table):
    model = make_model(table)
    prompts = [[1, 2], [3], [4, 5, 6]]
    stops = [[5, 9], [11], [12, 13, 14]]
    res = _run(model, prompts, max_tokens=60, stop_token_ids=stops)
    for i, p in enumerate(prompts):
        want, reason = expected(table, p, 60, stop_ids=tuple(stops[i]))
        assert res.token_ids[i] == want and res.finish_reason[i] == reason


def _table_with_sequence(seq, start, length=256):
    """A table whose greedy path from token `start` at position 0 walks `seq` repeatedly."""
    table = np.zeros((V, length), np.int64)
    path = [start]
    for pos in range(length):
        nxt = seq[pos % len(seq)]
        table[path[-1], pos] = nxt
        path.append(nxt)
    return table


def test_three_token_stop_sequence(table):
    model = make_model(table)
    prompt = [2, 3, 4]
    full, _ = expected(table, prompt, 40)
    seq = full[10:13]  # a 3-token sequence that does occur
    res = _run(model, [prompt], max_tokens=40, stop_sequences=[seq])
    want, reason = expected(table, prompt, 40, stop_seqs=[seq])
    assert res.token_ids[0] == want and reason == "stop"
    assert res.finish_reason == ["stop"] and res.stop_reason == [seq]


def test_self_overlapping_stop_sequence():
    # Output walks 1 1 1 2 1 1 1 2 ...; stop on [1, 1, 2] must fire on tokens 2..4 even though
    # a naive matcher that restarts after a mismatch would skip the overlapping start.
    table = np.zeros((V, 64), np.int64)
    walk = [1, 1, 1, 2] * 16
    prompt = [5]
    table[5, 0] = walk[0]
    for pos in range(1, 63):
        table[walk[pos - 1], pos] = walk[pos]
    model = make_model(table)
    res = _run(model, [prompt], max_tokens=30, stop_sequences=[[1, 1, 2]])
    assert res.token_ids[0] == [1, 1, 1, 2]
    assert res.finish_reason == ["stop"] and res.stop_reason == [[1, 1, 2]]


def test_max_tokens_is_exact(table):
    model = make_model(table)
    res = _run(model, [[1], [2], [3]], max_tokens=[1, 2, 33])
    assert res.num_tokens == [1, 2, 33]
    assert res.finish_reason == ["length"] * 3


def test_min_tokens_holds_back_eos():
    # Token 7 (EOS) is the most likely token at every step; min_tokens forces 5 others first.
    table = np.full((V, 64), 7)
    model = make_model(table, eos=(7,))

    def apply_fn(params, tokens, positions, cache):
        logits, cache = model.apply_fn(params, tokens, positions, cache)
        second = jnp.where(jnp.arange(V) == 9, 5.0, 0.0)  # runner-up: token 9
        return logits + second, cache

    model2 = ll.FunctionModel(apply_fn, model.params, model.init_cache, V, 512, (7,))
    params = ll.SamplingParams.create(
        batch_size=2, temperature=0.0, max_tokens=20, min_tokens=[5, 0]
    )
    res = ll.generate(model2, [[1], [1]], params)
    assert res.token_ids[0] == [9, 9, 9, 9, 9, 7]
    assert res.token_ids[1] == [7]
    assert res.finish_reason == ["stop", "stop"]


def test_finished_row_never_changes(table):
    model = make_model(table)
    job = plan(model)
    ids, params = job.rows(
        [[1], [2]], ll.SamplingParams.create(batch_size=2, temperature=0.0, max_tokens=[3, 40])
    )
    tables = job.tables(params)
    state = gen.initial_state(job.program, tables, ids)
    state = gen.decode(job.program, tables, state, jnp.asarray(5))
    snap = {k: np.asarray(getattr(state, k))[0].copy() for k in ("tokens", "logprobs")}
    cache_row = np.asarray(state.cache)[0].copy()
    assert bool(state.done[0]) and not bool(state.done[1])
    state = gen.decode(job.program, tables, state, jnp.asarray(10**6))
    assert bool(state.done[1])
    for k, v in snap.items():
        np.testing.assert_array_equal(np.asarray(getattr(state, k))[0], v)
    # The cache of the finished row holds its prompt and the tokens fed before it stopped.
    np.testing.assert_array_equal(np.asarray(state.cache)[0], cache_row)
    assert (cache_row >= 0).sum() == 1 + 2  # prompt + the first two generated tokens fed back


def test_n_samples_per_prompt_have_their_own_seeds(table):
    model = make_model(table)
    params = ll.SamplingParams.create(batch_size=2, temperature=5.0, max_tokens=12, seed=[3, 4])
    res = ll.generate(model, [[1], [2]], params, n=3)
    assert len(res.token_ids) == 6
    assert res.prompt_token_ids == [[1], [1], [1], [2], [2], [2]]
    assert len({tuple(t) for t in res.token_ids[:3]}) == 3  # children differ
    single = ll.generate(model, [[1]], params.take([0]))
    assert res.token_ids[0] == single.token_ids[0]  # child 0 keeps the row's seed


def test_logprobs_match_the_closed_form(table):
    # The scripted logits are 10 at the scripted token and 0 at the V - 1 others, so every
    # log-probability has a closed form (float64 here). Row 0 samples at temperature 2 with
    # no truncation (the final distribution puts 5 against 0); row 1 at temperature 1 with
    # min_p = 0.1, which keeps the scripted token alone (final log-probability 0).
    model = make_model(table)
    params = ll.SamplingParams.create(
        batch_size=2,
        temperature=[2.0, 1.0],
        min_p=[0.0, 0.1],
        max_tokens=8,
        logprobs=[3, 5],
        seed=[1, 2],
    )
    res = ll.generate(model, [[1], [2]], params)
    top_raw = 10 - np.log(np.exp(10.0) + (V - 1))  # raw log-softmax of the scripted token
    other_raw = -np.log(np.exp(10.0) + (V - 1))
    hits = []
    for r, (prompt, n) in enumerate([(1, 3), (2, 5)]):
        assert res.num_tokens[r] == 8
        prev = prompt
        for i, tok in enumerate(res.token_ids[r]):
            scripted = int(table[prev, i])  # prompt of one token: position i feeds index i
            hit = tok == scripted
            hits.append((r, hit))
            want_raw = top_raw if hit else other_raw
            if r == 0:
                want = (5.0 if hit else 0.0) - np.log(np.exp(5.0) + (V - 1))
            else:
                assert hit  # min_p keeps nothing else
                want = 0.0
            assert res.raw_logprobs[r][i] == pytest.approx(want_raw, rel=1e-6, abs=1e-6)
            assert res.logprobs[r][i] == pytest.approx(want, rel=1e-6, abs=1e-6)
            top = res.top_logprobs[r][i]
            assert len(top) == n
            assert top[scripted] == pytest.approx(top_raw, rel=1e-6, abs=1e-6)
            assert list(top)[0] == scripted  # the most likely first
            others = [v for t, v in top.items() if t != scripted]
            np.testing.assert_allclose(others, other_raw, rtol=1e-6, atol=1e-6)
            prev = tok
    assert {(0, True), (0, False)} <= set(hits)  # row 0's seed exercises both closed forms


@pytest.mark.parametrize(
    "prompts, knobs, match",
    [
        ([[1], []], {}, r"prompts\[1\] is empty"),
        ([[1], [V]], {}, r"prompts\[1\] holds token id 40, outside the vocabulary range \[0, 39\]"),
        (
            [[1], [2] * 500],
            {"max_tokens": 20},
            r"prompts\[1\] has 500 tokens and max_tokens\[1\] = 20",
        ),
        ([[1]], {"batch": 2}, r"params has batch_size 2 but there are 1 prompts"),
        ([[1], [2]], {"stop_token_ids": [[1], [V + 3]]}, r"stop_token_ids\[1\] holds token id 43"),
    ],
)
def test_bad_input(table, prompts, knobs, match):
    model = make_model(table)
    batch = knobs.pop("batch", len(prompts))
    params = ll.SamplingParams.create(batch_size=batch, **knobs)
    with pytest.raises(ValueError, match=match):
        ll.generate(model, prompts, params)


def test_no_recompilation_across_values_lengths_and_max_tokens(table, compile_counter):
    model = make_model(table)

    def run(prompts, **knobs):
        params = ll.SamplingParams.create(batch_size=len(prompts), **knobs)
        return ll.generate(model, prompts, params)

    run([[1, 2, 3], [4, 5]], temperature=0.0, max_tokens=20)
    with compile_counter as c:
        run(
            [[7, 8], [9, 1, 2, 3, 4, 5, 6]],
            temperature=[0.5, 1.2],
            top_k=[3, 0],
            top_p=[1.0, 0.8],
            min_p=0.1,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=[11, 12],
            max_tokens=[30, 17],
            min_tokens=[2, 0],
            logit_bias={3: 1.5},
            banned_token_ids=[4],
            stop_token_ids=[9],
        )
        run([[1] * 16, [2]], temperature=2.0, max_tokens=25)
    assert c.count == 0
