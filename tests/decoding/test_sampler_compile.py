"""Changing any sampling value never recompiles `sample` (counted, not timed)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import logitloop as ll

B, V = 4, 307  # a shape of this test's own, so that its first call does compile


def _call(rng, history, **knobs):
    logits = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32) * 3)
    params = ll.SamplingParams.create(batch_size=B, vocab_size=V, **knobs)
    positions = jnp.asarray(rng.integers(0, 10, B), jnp.int32)
    return ll.sample(logits, params, positions, history)


def _ids(rng, n):
    return rng.choice(V, n, replace=False).tolist()


def test_new_values_compile_nothing(compile_counter):
    rng = np.random.default_rng(0)
    hist = ll.History.create([[1, 2], [3], [4, 5, 6], [7]], vocab_size=V, capacity=8)
    # The top logprobs are as wide as the widest row asks (one program per width): row 0
    # asks for 20 throughout, the other rows' values change and compile nothing.
    wide = [20, 0, 0, 0]
    base = dict(logprobs=wide, logit_bias={5: 1.0}, banned_token_ids=[9], stop_token_ids=[1])
    with compile_counter as c:
        _call(rng, hist, **base)
    assert c.count > 0  # the counter sees this shape's compile
    with compile_counter as c:
        for trial in range(5):  # 0..4
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
                logprobs=[20, *rng.integers(0, 21, B - 1).tolist()],
                # Lists of 0 to 4 entries: all inside the smallest bucket (MIN_LIST_WIDTH).
                logit_bias={int(t): float(rng.uniform(-5, 5)) for t in _ids(rng, trial)},
                banned_token_ids=_ids(rng, 4 - trial),
                allowed_token_ids=None if trial % 2 else [_ids(rng, 4), None, [3], None],
                stop_token_ids=_ids(rng, trial),
            )
    assert c.count == 0
