"""The repetition guard against a NumPy scan of the token stream: on random streams with loops
of periods 1-8, token by token (`repetition.periods_after_each`, the loop's own update) and
through `generate`, with and without stops."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.loop.repetition import periods_after_each

from .scripted import expected, make_model


def reference_period(stream: list[int], max_period: int, min_repeats: int) -> int:
    """The shortest p <= max_period whose last p * min_repeats tokens of `stream` repeat one
    period of p tokens, or 0: a plain scan, float-free and loop by loop."""
    for p in range(1, max_period + 1):
        tail = stream[-p * min_repeats :]
        if len(tail) == p * min_repeats and all(tail[i] == tail[i % p] for i in range(len(tail))):
            return p
    return 0


def looping_streams(rng, rows: int, length: int, vocab: int) -> np.ndarray:
    """Random tokens, then in most rows a random period of 1-8 tokens repeated."""
    out = rng.integers(0, vocab, (rows, length))
    for r in range(rows):
        if rng.random() < 0.8:
            p, start = int(rng.integers(1, 9)), int(rng.integers(0, length // 2))
            pattern = rng.integers(0, vocab, p)
            out[r, start:] = np.resize(pattern, length - start)
    return out


def test_hits_match_a_numpy_scan():
    rng = np.random.default_rng()
    rows, length = 48, 40
    streams = looping_streams(rng, rows, length, vocab=6)  # a small vocabulary: near misses
    periods = rng.integers(0, 9, rows)  # 0: no guard
    repeats = rng.integers(2, 6, rows)
    got = np.asarray(
        periods_after_each(jnp.asarray(streams, jnp.int32), jnp.asarray(periods, jnp.int32),
                           jnp.asarray(repeats, jnp.int32))
    )  # fmt: skip
    hits = 0
    for r in range(rows):
        for n in range(1, length + 1):
            want = reference_period(streams[r, :n].tolist(), int(periods[r]), int(repeats[r]))
            assert got[n - 1, r] == want, (r, n, streams[r, :n], periods[r], repeats[r])
            hits += want > 0
    assert hits > rows  # many prefixes do end in a loop


V = 24


def _looping_table(rng) -> np.ndarray:
    """A scripted model's table ([token, position] -> next token) with cycles of 1-8 tokens
    that some paths fall into."""
    table = rng.integers(0, V, (V, 96))
    tokens = rng.permutation(V)
    at = 0
    for p in (1, 2, 3, 5, 8):
        cycle = tokens[at : at + p]
        at += p
        for i, t in enumerate(cycle):
            table[t, :] = cycle[(i + 1) % p]
    return table


def _reference_row(table, prompt, max_tokens, stop_ids, guard):
    stream, reason = expected(table, prompt, max_tokens, stop_ids=stop_ids)
    if guard is None:
        return stream, reason
    for n in range(1, len(stream) + 1):
        if stream[n - 1] in stop_ids:
            break  # a stop token ends the row first
        if reference_period(stream[:n], *guard):
            return stream[:n], "repetition"
    return stream, reason


def test_generate_cuts_where_the_scan_does_with_and_without_stops(compile_counter):
    rng = np.random.default_rng()
    table = _looping_table(rng)
    model = make_model(table)
    rows = 12
    prompts = [[int(t)] for t in rng.integers(0, V, rows)]
    guards = [
        None if r % 4 == 0 else (int(rng.integers(1, 9)), int(rng.integers(2, 5)))
        for r in range(rows)
    ]
    stops = [[int(t) for t in rng.integers(0, V, r % 3)] for r in range(rows)]
    knobs = dict(temperature=0.0, max_tokens=48, stop_token_ids=stops)
    got = ll.generate(model, prompts, repetition_guard=guards, **knobs)
    for r in range(rows):
        want = _reference_row(table, prompts[r], 48, stops[r], guards[r])
        assert (got.token_ids[r], got.finish_reason[r]) == want, (r, guards[r], stops[r])
    assert "repetition" in got.finish_reason
    assert got.stop_reason[got.finish_reason.index("repetition")] is None
    # Rows without a guard are unchanged; a new setting compiles nothing.
    with compile_counter as c:
        plain = ll.generate(model, prompts, repetition_guard=None, **knobs)
        other = ll.generate(model, prompts, repetition_guard=(8, 2), **knobs)
    assert c.count == 0
    for r in range(0, rows, 4):
        assert got.token_ids[r] == plain.token_ids[r]
        assert got.logprobs[r] == plain.logprobs[r]
    for r in range(rows):
        want = _reference_row(table, prompts[r], 48, stops[r], (8, 2))
        assert (other.token_ids[r], other.finish_reason[r]) == want


@pytest.mark.parametrize(
    "guard, match",
    [
        ((0, 3), r"repetition_guard max_period = 0 is outside the allowed range \[1, 32\]"),
        ((4, 1), r"repetition_guard min_repeats = 1 is outside the allowed range \[2, 65536\]"),
        ([(32, 2), (8, 2.5)], r"repetition_guard\[1\] min_repeats = 2.5 is not an integer"),
        ("x", r"repetition_guard must be a \(max_period, min_repeats\) pair"),
    ],
)
def test_bad_guards_name_the_argument(guard, match):
    with pytest.raises(ValueError, match=match):
        ll.SamplingParams.create(len(guard) if isinstance(guard, list) else 1,
                                 repetition_guard=guard)  # fmt: skip


def test_explain_says_where_the_guard_would_cut():
    from logitloop.decoding.engine.explain import explain_next_token

    rng = np.random.default_rng()
    model = make_model(_looping_table(rng))
    period = int(rng.integers(1, 4))
    prompt = [*rng.integers(0, V, 5).tolist(), *rng.integers(0, V, period).tolist() * 3]
    guard = (4, 3)
    greedy = ll.SamplingParams.create(temperature=0.0, repetition_guard=guard)
    expl = explain_next_token(model, prompt, greedy)
    stream = [*prompt, expl.sampled_token]
    cuts = [(n, reference_period(stream[:n], *guard)) for n in range(1, len(stream) + 1)]
    assert expl.repetition_cut == next(c for c in cuts if c[1])  # the prompt loops
    plain = explain_next_token(model, prompt, greedy.replace(guard_period=np.zeros(1, np.int32)))
    assert plain.repetition_cut is None  # no guard, no cut
