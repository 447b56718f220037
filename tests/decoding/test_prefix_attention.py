"""generate() over a long KV cache, where each decode step attends only a prefix of it.

A decode step (`logitloop.ops.attention.api.decode_attention`) reads the shortest of S/8,
S/4, S/2 or S slots that holds every visible slot once the cache has `api.MIN_PREFIX_SLOTS`
slots or more. The reference feeds the same
tokens through the model protocol with that path turned off, so every step attends the full
cache: each generated token's raw log-probability must be its log-softmax, and the greedy
row's tokens its argmax, at every step. The positions cross every prefix boundary, so a
prefix one slot too short changes the output at the step that crosses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.ops.attention import api

from .random_llama import small_llama

# Prompts of 60 and 41 tokens bucket to P = 64 and 460 new tokens to a buffer of 512: a
# cache of S = 576 slots, prefixes 72, 144, 288 and 576. Row 0's positions run from 60 to
# 519, so the decode steps use each of the four prefixes.
PROMPT_LENGTHS = (60, 41)
MAX_TOKENS = 460
SLOTS = 64 + 512
VOCAB = 97


@pytest.fixture(scope="module")
def model():
    return small_llama(VOCAB, 1024, 5)


def full_cache_log_softmax(model, prompts, generated, monkeypatch) -> np.ndarray:
    """`[B, N, V]`: log-softmax of the logits each generated token was drawn from, fed one
    column per step through the model protocol with the prefix path turned off (every
    decode step attends all slots)."""
    monkeypatch.setattr(api, "MIN_PREFIX_SLOTS", 10**9)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, cache):
        logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return jax.nn.log_softmax(logits, axis=-1), cache

    batch, steps = generated.shape
    plen = max(len(p) for p in prompts)
    tokens = np.zeros((batch, plen), np.int32)
    positions = np.full((batch, plen), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, plen - len(prompt) :] = prompt
        positions[row, plen - len(prompt) :] = np.arange(len(prompt))
    cache = model.init_cache(batch, plen + steps)
    logp, cache = forward(state, jnp.asarray(tokens), jnp.asarray(positions), cache)
    out = [logp]
    next_position = np.asarray([len(p) for p in prompts], np.int32)
    for i in range(steps - 1):
        column = jnp.asarray(generated[:, i : i + 1])
        logp, cache = forward(state, column, jnp.asarray(next_position[:, None] + i), cache)
        out.append(logp)
    return np.stack([np.asarray(o) for o in out], axis=1)


def test_long_cache_generate_equals_full_cache_forward(model, monkeypatch):
    traced = []
    attend = api.decode_attention

    def spy(q, k, v, mask, scale, softcap):
        traced.append((q.shape[1], k.shape[2]))
        return attend(q, k, v, mask, scale, softcap)

    monkeypatch.setattr(api, "decode_attention", spy)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    params = ll.SamplingParams.create(
        batch_size=2, temperature=[0.0, 0.9], top_p=[1.0, 0.95], seed=[3, 4], max_tokens=MAX_TOKENS
    )
    out = ll.generate(model, prompts, params, ignore_eos=True)
    assert SLOTS >= api.MIN_PREFIX_SLOTS
    assert (1, SLOTS) in traced  # the decode steps went through the prefix path
    assert out.num_tokens == [MAX_TOKENS] * 2

    monkeypatch.setattr(api, "decode_attention", attend)
    generated = np.asarray(out.token_ids, np.int32)  # [B, N]
    logp = full_cache_log_softmax(model, prompts, generated, monkeypatch)  # [B, N, V]
    for row in range(2):
        chosen = logp[row, np.arange(MAX_TOKENS), generated[row]]
        np.testing.assert_allclose(out.raw_logprobs[row], chosen, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(generated[0], np.argmax(logp[0], axis=-1))  # greedy row
