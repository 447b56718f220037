"""generate() on a small random Llama: rows of a ragged batch equal the prompt run alone."""

from __future__ import annotations

import numpy as np
import pytest

import logitloop as ll

from .random_llama import small_llama


@pytest.fixture(scope="module")
def model():
    return small_llama(97, 256, 3)


PROMPTS = [[5, 17, 3], [40], [8, 9, 10, 11, 12, 13, 14], [60, 2]]
KNOBS = dict(
    temperature=[0.0, 0.9, 1.2, 0.7],
    top_k=[0, 20, 0, 5],
    top_p=[1.0, 0.9, 0.95, 1.0],
    repetition_penalty=[1.0, 1.2, 1.0, 1.1],
    seed=[11, 12, 13, 14],
    max_tokens=[12, 7, 16, 9],
)


def _row(i):
    return {k: [v[i]] for k, v in KNOBS.items()}


def test_ragged_rows_equal_each_prompt_alone(model):
    batch = ll.generate(model, PROMPTS, ll.SamplingParams.create(batch_size=4, **KNOBS))
    for i, prompt in enumerate(PROMPTS):
        alone = ll.generate(model, [prompt], ll.SamplingParams.create(batch_size=1, **_row(i)))
        assert batch.token_ids[i] == alone.token_ids[0], i
        np.testing.assert_allclose(batch.logprobs[i], alone.logprobs[0], atol=1e-4)


def test_same_seed_same_output_across_runs(model):
    params = ll.SamplingParams.create(batch_size=4, **KNOBS)
    first = ll.generate(model, PROMPTS, params)
    again = ll.generate(model, PROMPTS, ll.SamplingParams.create(batch_size=4, **KNOBS))
    assert first.token_ids == again.token_ids
    other = dict(KNOBS, seed=[21, 22, 23, 24])
    changed = ll.generate(model, PROMPTS, ll.SamplingParams.create(batch_size=4, **other))
    assert changed.token_ids[1:] != first.token_ids[1:]  # sampled rows follow their seeds
    assert changed.token_ids[0] == first.token_ids[0]  # the greedy row does not
