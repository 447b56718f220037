"""A prompt pass that would not fit the device's memory fails before it runs, with the
memory it needs (`logitloop.decoding.engine.memory_check`). The CPU reports no memory limit, so
the device's report is replaced here."""

from __future__ import annotations

import pytest

import logitloop as ll
from logitloop.decoding.engine import memory_check

from .random_llama import small_llama


def test_a_pass_over_the_free_memory_raises_with_what_it_needs(monkeypatch):
    model = small_llama(97, 256, 0)
    params = ll.SamplingParams.create(batch_size=2, max_tokens=4, seed=0)
    prompts = [[5] * 40, [7] * 9]
    monkeypatch.setattr(memory_check, "LONG_PROMPT_TOKENS", 64)  # this batch: 2 x 48 tokens
    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**16, 2**20))
    with pytest.raises(ValueError, match=r"prompts: the prompt pass needs .* GiB .* free of"):
        ll.generate(model, prompts, params)
    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**34, 2**34))
    assert ll.generate(model, prompts, params).num_tokens == [4, 4]
    monkeypatch.setattr(memory_check, "LONG_PROMPT_TOKENS", 10**6)  # short: not checked
    monkeypatch.setattr(memory_check, "device_memory", lambda: (2**16, 2**20))
    assert ll.generate(model, prompts, params).num_tokens == [4, 4]
