"""`generate` and `stream`: changing any value never recompiles; what must compile, does once.

Counted with jax.monitoring compile events, not timed. Each test builds a model around a
forward function of its own, so its first call always compiles (the counter is shown to fire)
whatever ran before in the session.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll

from .scripted import _apply, _init_cache

V = 48
PIECES = [bytes([97 + i % 26]) * (1 + i % 3) for i in range(V)]  # "a", "bb", "ccc", "d", ...


class _Bytes:
    """Token i is the byte string PIECES[i]."""

    vocab_size = V

    def token_bytes(self, i: int) -> bytes:
        return PIECES[i]


def _model(apply_fn):
    table = np.random.default_rng(7).integers(0, V, size=(V, 64))
    return ll.FunctionModel(
        apply_fn, jnp.asarray(table, jnp.int32), _init_cache, V, 64, tokenizer=_Bytes()
    )


def _apply_a(params, tokens, positions, cache):
    return _apply(params, tokens, positions, cache)


def _apply_b(params, tokens, positions, cache):
    return _apply(params, tokens, positions, cache)


def _apply_c(params, tokens, positions, cache):
    return _apply(params, tokens, positions, cache)


def _ids(rng, lo, hi):
    return rng.choice(V, int(rng.integers(lo, hi + 1)), replace=False).tolist()


def _stop_string(rng, max_bytes):
    return "".join(rng.choice(list("abcdefgh"), int(rng.integers(1, max_bytes + 1))))


def _random_knobs(rng, batch):
    """Every knob at a random value, every list within its bucket (the minimum, 4 entries;
    stop sequences within [2 sequences, 4 tokens]; stop strings within [4, 16 bytes])."""
    return dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], batch).tolist(),
        top_k=rng.integers(-1, V + 5, batch).tolist(),
        top_p=rng.uniform(0.05, 1.0, batch).tolist(),
        min_p=rng.choice([0.0, 0.1, 0.5], batch).tolist(),
        repetition_penalty=rng.uniform(0.5, 2.0, batch).tolist(),
        presence_penalty=rng.uniform(-1, 1, batch).tolist(),
        frequency_penalty=rng.uniform(-1, 1, batch).tolist(),
        seed=rng.integers(0, 2**32, batch).tolist(),
        max_tokens=rng.integers(4, 17, batch).tolist(),
        min_tokens=rng.integers(0, 4, batch).tolist(),
        # Row 0 fills the width (the top logprobs are as wide as the widest row asks).
        logprobs=[20] + rng.integers(0, 21, batch - 1).tolist(),
        logit_bias=[{t: float(rng.uniform(-3, 3)) for t in _ids(rng, 0, 4)} for _ in range(batch)],
        banned_token_ids=[_ids(rng, 0, 4) for _ in range(batch)],
        allowed_token_ids=[None if rng.random() < 0.5 else _ids(rng, 1, 4) for _ in range(batch)],
        stop_token_ids=[_ids(rng, 0, 4) for _ in range(batch)],
        # Row 0 fills the bucket (2 sequences, one of 3 or 4 tokens); the others vary freely.
        stop_sequences=[[_ids(rng, 3, 4), _ids(rng, 1, 4)]]
        + [[_ids(rng, 1, 4) for _ in range(int(rng.integers(0, 3)))] for _ in range(batch - 1)],
        stop=[
            [_stop_string(rng, 16) for _ in range(int(rng.integers(1 if r == 0 else 0, 5)))]
            for r in range(batch)
        ],
        include_stop_str_in_output=(rng.random(batch) < 0.5).tolist(),
    )


def _prompts(rng, batch):
    return [rng.integers(0, V, int(rng.integers(1, 17))).tolist() for _ in range(batch)]


def test_changing_any_value_never_recompiles(compile_counter):
    model = _model(_apply_a)
    rng = np.random.default_rng(0)
    batch = 3
    with compile_counter as c:
        ll.generate(
            model,
            _prompts(rng, batch),
            ll.SamplingParams.create(batch, **_random_knobs(rng, batch)),
        )
    assert c.count > 0  # a new model compiles: the counter does see this test's programs
    with compile_counter as c:
        for trial in range(4):
            params = ll.SamplingParams.create(batch, **_random_knobs(rng, batch))
            prompts = _prompts(rng, batch)
            res = ll.generate(model, prompts, params)
            events = list(ll.stream(model, prompts, params, chunk_steps=1 + trial))
            assert sum(len(e.token_ids) for e in events) == sum(res.num_tokens)
    assert c.count == 0


def _compiles(counter, model, prompts=([1, 2], [3]), **knobs) -> bool:
    with counter as c:
        ll.generate(model, list(prompts), ll.SamplingParams.create(len(prompts), **knobs))
    return c.count > 0


@pytest.mark.slow  # several new programs compiled on purpose: about 35 s
def test_logprobs_and_stop_string_tables_compile_once(compile_counter):
    """The value changes docs/performance.md ("What compiles") names as compiling: each
    compiles once, then never again."""
    model = _model(_apply_b)
    base = dict(max_tokens=8, stop=[["a"], []])
    assert _compiles(compile_counter, model, **base)  # first call
    assert not _compiles(compile_counter, model, **{**base, "stop": [["b", "cc"], ["d"]]})
    # logprobs from 0 to > 0: the loop then carries top-logprob buffers 20 wide (one more
    # program, kept: logprobs 0 after compiles nothing), whatever width a row asks.
    assert _compiles(compile_counter, model, **base, logprobs=[0, 3])
    assert not _compiles(compile_counter, model, **base, logprobs=[3, 1])
    assert not _compiles(compile_counter, model, **base, logprobs=[20, 1])
    assert not _compiles(compile_counter, model, **base)
    # No stop string in any row: the tables are there all the same (the model has a
    # tokenizer), empty.
    assert not _compiles(compile_counter, model, max_tokens=8)
    assert not _compiles(compile_counter, model, max_tokens=8, stop=[[], ["e" * 16]])


@pytest.mark.slow
def test_lists_outgrowing_their_bucket_compile_once(compile_counter):
    """5 stop strings, a 17-byte stop string, 5 banned ids: each compiles once."""
    model = _model(_apply_c)
    base = dict(max_tokens=8, stop=[["a"], []])
    assert _compiles(compile_counter, model, **base)
    for change in (
        dict(stop=[["a", "b", "c", "d", "e"], []]),
        dict(stop=[["f" * 17], []]),
        dict(banned_token_ids=[1, 2, 3, 4, 5]),
    ):
        knobs = {**base, **change}
        assert _compiles(compile_counter, model, **knobs), change
        assert not _compiles(compile_counter, model, **knobs), change
    # Within the grown buckets, nothing compiles.
    assert not _compiles(compile_counter, model, **{**base, "banned_token_ids": list(range(8))})
