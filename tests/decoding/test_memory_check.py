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


def test_the_cli_default_pool_is_what_the_free_memory_holds(monkeypatch):
    """`default_kv_cache_tokens`: 80% of the free bytes in tokens of KV, in whole pages,
    where the contiguous slots would not fit; None (the contiguous slots) where they fit or
    the device does not report its memory. The CLI passes it the job's slots."""
    import argparse

    from logitloop.cli import run_generate
    from logitloop.decoding.loop.runner import model_info

    info = model_info(small_llama(97, 256, 0))
    per_token = info.runner.kv_bytes_per_token(info.weights)
    assert per_token == 2 * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x head_dim x float32
    mib = 2**20
    assert memory_check.default_kv_cache_tokens(per_token, 10**6, 16, (mib, 2 * mib)) == 3264
    assert memory_check.default_kv_cache_tokens(per_token, 3000, 16, (mib, 2 * mib)) is None
    assert memory_check.default_kv_cache_tokens(per_token, 10**6, 16, None) is None
    assert memory_check.default_kv_cache_tokens(per_token, 10**6, 16, (100, mib)) == 16
    args = argparse.Namespace(kv_cache_tokens=None, page_size=16)
    shapes = dict(slots=4, max_prompt_len=20, max_tokens_bound=100)  # 4 x (32 + 128) tokens
    monkeypatch.setattr(memory_check, "device_memory", lambda: None)
    assert run_generate._kv_cache_tokens(args, info, shapes) is None
    monkeypatch.setattr(memory_check, "device_memory", lambda: (100_000, mib))
    assert run_generate._kv_cache_tokens(args, info, shapes) == 304  # 80 000 // 256, in pages
    monkeypatch.setattr(memory_check, "device_memory", lambda: (250_000, mib))
    assert run_generate._kv_cache_tokens(args, info, shapes) is None  # 768 > 640 tokens
    args.kv_cache_tokens = 96
    assert run_generate._kv_cache_tokens(args, info, shapes) == 96
