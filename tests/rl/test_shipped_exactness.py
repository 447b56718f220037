"""The shipped model in bfloat16 (issue 54): each way a rollout can be sampled with
`deterministic=True` (`n = 3` on shared prefix pages; `generate_many` with contiguous
slots, a paged pool, the prefix cache) reports the raw and processed log-probs that
`ll.score` computes for the same tokens, bit for bit; and `ll.token_logprobs` traced into a
user's own `jax.jit` compiled with `fixed_order.compiler_options()` gives the rollout's
log-probs bit for bit. Two short prompts, 4 tokens; still each way compiles programs of
its own (~80 s of a loaded 2-core machine for the shipped model), so they run under
`-m slow` with the family matrix of tests/rl/test_token_logprobs.py; by default the
user's-jit case runs on the tests' small random bfloat16 Llama."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.models import fixed_order
from tests.rl.family_models import flat_results

PROMPTS = ["def f(x):", "import"]
SETTINGS = dict(temperature=1.0, top_p=0.9, max_tokens=4, logprobs=1)


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def shipped():
    return ll.load_pretrained()  # bfloat16


def _rollouts(model):
    """name -> (prompt ids, tokens, raw, processed, params) per row, every way sampled."""
    out = {}
    params = ll.SamplingParams.create(2, seed=[1, 2], **SETTINGS)
    gen = ll.generate(model, PROMPTS, params, n=3, ignore_eos=True, deterministic=True)
    out["n=3 shared pages"] = (gen, params.samples(3))
    reqs = [ll.Request(p, dict(SETTINGS, seed=i + 1)) for i, p in enumerate(PROMPTS)]
    for name, kv, prefix in (("contiguous", None, None), ("paged", 256, False),
                             ("prefix cache", 256, True)):  # fmt: skip
        res = ll.generate_many(model, reqs, deterministic=True, ignore_eos=True, slots=2,
                               kv_cache_tokens=kv, prefix_cache=prefix)  # fmt: skip
        flat = flat_results(res)
        out[f"generate_many {name}"] = (flat, params)
    return out


@pytest.mark.slow
def test_every_rollout_way_equals_score_bit_for_bit(shipped):
    rollouts = _rollouts(shipped)
    # One score call over every way's rows (one compile), then row by row.
    prompts, tokens, params = [], [], []
    for gen, p in rollouts.values():
        prompts += gen.prompt_token_ids
        tokens += gen.token_ids
        params.append(p)
    scored = ll.score(shipped, prompts, tokens, ll.SamplingParams.concat(params),
                      deterministic=True)  # fmt: skip
    row = 0
    for name, (gen, _) in rollouts.items():
        for r in range(len(gen.token_ids)):
            s = scored[row]
            row += 1
            np.testing.assert_array_equal(_bits(s.raw_logprobs), _bits(gen.raw_logprobs[r]),
                                          err_msg=f"{name}, row {r}: raw")  # fmt: skip
            np.testing.assert_array_equal(_bits(s.logprobs), _bits(gen.logprobs[r]),
                                          err_msg=f"{name}, row {r}: processed")  # fmt: skip


@pytest.mark.slow
def test_token_logprobs_inside_a_users_jit_is_exact(shipped):
    """bf16: the user's jit must carry the deterministic compiler options (docs/rl.md)."""
    params = ll.SamplingParams.create(2, seed=[1, 2], **SETTINGS)
    gen = ll.generate(shipped, PROMPTS, params, ignore_eos=True, deterministic=True)
    batch = ll.rollout_batch(gen)
    ids, plen, lens = batch.token_ids, batch.prompt_lengths, batch.lengths
    raw, processed = _in_users_jit(shipped, ids, plen, lens, params)
    for r in range(2):
        got = slice(plen[r], lens[r])
        np.testing.assert_array_equal(_bits(raw[r, got]), _bits(gen.raw_logprobs[r]))
        np.testing.assert_array_equal(_bits(processed[r, got]), _bits(gen.logprobs[r]))


def _in_users_jit(model, ids, plen, lens, params):
    """token_logprobs traced into a user's own `jax.jit` of a function of the weights."""
    graphdef, weights = nnx.split(model)

    @jax.jit(compiler_options=fixed_order.compiler_options())
    def users_step(weights):
        out = ll.token_logprobs(nnx.merge(graphdef, weights), ids, plen, params, lengths=lens)
        return out.raw_logprobs, out.logprobs

    return users_step(weights)
