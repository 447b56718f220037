"""Changing any sampling value never recompiles `sample` (counted, not timed)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import logitloop as ll

B, V = 4, 300


def _call(rng, history, **knobs):
    logits = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32) * 3)
    params = ll.SamplingParams.create(batch_size=B, vocab_size=V, **knobs)
    positions = jnp.asarray(rng.integers(0, 10, B), jnp.int32)
    return ll.sample(logits, params, positions, history)


def test_new_values_compile_nothing(compile_counter):
    rng = np.random.default_rng(0)
    hist = ll.History.create([[1, 2], [3], [4, 5, 6], [7]], vocab_size=V, capacity=8)
    base = dict(logprobs=2, logit_bias={5: 1.0}, banned_token_ids=[9], stop_token_ids=[1])
    _call(rng, hist, **base)
    with compile_counter as c:
        for trial in range(5):
            _call(
                rng,
                hist,
                temperature=rng.uniform(0, 2, B).tolist() if trial else 0.0,
                top_k=rng.integers(0, 400, B).tolist(),
                top_p=rng.uniform(0.1, 1.0, B).tolist(),
                min_p=rng.uniform(0, 0.3, B).tolist(),
                repetition_penalty=rng.uniform(0.5, 2, B).tolist(),
                presence_penalty=rng.uniform(-2, 2, B).tolist(),
                frequency_penalty=rng.uniform(-2, 2, B).tolist(),
                seed=rng.integers(0, 2**32, B).tolist(),
                min_tokens=rng.integers(0, 5, B).tolist(),
                max_tokens=10,
                logprobs=rng.integers(0, 21, B).tolist(),
                logit_bias={int(rng.integers(V)): float(rng.uniform(-5, 5))},
                banned_token_ids=[int(rng.integers(V))],
                allowed_token_ids=None if trial % 2 else [[1, 2], None, [3], None],
                stop_token_ids=[int(rng.integers(V))],
            )
    assert c.count == 0
