"""MoE routing replay (issue 54): `generate(..., return_routing=True)` records the experts
each routed layer sent each token to, `ll.token_logprobs(..., routing=)` replays them.

With `deterministic=True` replay changes nothing, bit for bit (`-m slow`: it compiles
generate and the trainer program, ~40 s here); a replayed mixture is the mixture of the
given experts weighted by the router's probabilities (against float64 NumPy); a record of
another shape, layer count, k or expert range, or for a model that does not route, is
refused naming `routing`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.models.fixed_order import PLAIN
from tests.rl.family_models import family_model

PROMPTS = [[1, 5, 7, 9], [3, 4], [11, 12, 13, 14, 15, 16, 2]]


def _rows(gen):
    """token_ids [B, T], prompt_lengths, lengths and routing [B, T, L, k] (-1 after each
    row) from a generate result with `return_routing=True`."""
    longest = max(len(p) + len(t) for p, t in zip(gen.prompt_token_ids, gen.token_ids, strict=True))
    batch = ll.rollout_batch(gen, width=longest + 1)
    return batch.token_ids, batch.prompt_lengths, batch.lengths, batch.routing


@pytest.fixture(scope="module")
def moe():
    return family_model("qwen3_moe", "bfloat16")


@pytest.fixture(scope="module")
def moe32():
    return family_model("qwen3_moe", "float32")


@pytest.fixture(scope="module")
def rollout(moe):
    params = ll.SamplingParams.create(3, temperature=1.0, max_tokens=6, seed=[1, 2, 3], logprobs=1)
    gen = ll.generate(moe, PROMPTS, params, deterministic=True, ignore_eos=True,
                      return_routing=True)  # fmt: skip
    return params, gen


@pytest.mark.slow
def test_routing_record_is_aligned_with_prompt_and_completion(moe, rollout):
    _, gen = rollout
    layers, k = len(moe.routed_layers()), moe.config.num_experts_per_tok
    for r, record in enumerate(gen.routing):
        assert record.dtype == np.int32
        assert record.shape == (len(gen.prompt_token_ids[r]) + len(gen.token_ids[r]), layers, k)
        assert np.all(record[:-1] >= 0) and np.all(record[:-1] < moe.config.num_experts)
        assert np.all(record[-1] == -1)  # the last generated token was never fed back
        for row in record[:-1].reshape(-1, k):
            assert len(set(row.tolist())) == k  # k distinct experts per token and layer


@pytest.mark.slow
def test_replay_in_deterministic_mode_changes_nothing_bit_for_bit(moe, rollout):
    """bf16: token_logprobs with the recorded routing == without == the rollout's own."""
    params, gen = rollout
    ids, plen, lens, routing = _rows(gen)
    plain = ll.token_logprobs(moe, ids, plen, params, lengths=lens)
    replay = ll.token_logprobs(moe, ids, plen, params, lengths=lens, routing=routing)
    for name in ("raw_logprobs", "logprobs"):
        a, b = (np.asarray(getattr(x, name)).view(np.uint32) for x in (plain, replay))
        np.testing.assert_array_equal(a, b)
    for r in range(len(ids)):
        got = np.asarray(replay.raw_logprobs[r, plen[r] : lens[r]])
        want = np.asarray(gen.raw_logprobs[r], np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_replayed_mixture_is_the_given_experts_weighted_by_the_router(moe32):
    """One sparse layer with forced experts (not its own top k) against float64 NumPy."""
    block = moe32.layers[0]
    c = block.config
    h = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, c.hidden_size)), np.float32)
    own = block.mlp(jnp.asarray(h), PLAIN, routing=jnp.full((2, 3, 3), -1, jnp.int32))[1]
    forced = (np.asarray(own) + 1) % c.num_experts  # other experts than the router's
    forced[0, 0] = -1  # this token keeps its own routing
    out, used = block.mlp(jnp.asarray(h), PLAIN, routing=jnp.asarray(forced, jnp.int32))
    np.testing.assert_array_equal(np.asarray(used[0, 0]), np.asarray(own[0, 0]))
    np.testing.assert_array_equal(np.asarray(used).reshape(-1, 3)[1:], forced.reshape(-1, 3)[1:])

    w = {n: np.asarray(getattr(block, n)[...], np.float64) for n in
         ("router", "w_gate", "w_up", "w_down")}  # fmt: skip
    flat, experts = h.reshape(-1, c.hidden_size).astype(np.float64), np.asarray(used).reshape(-1, 3)
    logits = flat @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.zeros_like(flat)
    for i, (x, ids) in enumerate(zip(flat, experts, strict=True)):
        weights = probs[i, ids] / probs[i, ids].sum()  # norm_topk_prob
        for wj, j in zip(weights, ids, strict=True):
            gate, up = x @ w["w_gate"][j], x @ w["w_up"][j]
            want[i] += wj * ((gate / (1 + np.exp(-gate)) * up) @ w["w_down"][j])
    np.testing.assert_allclose(np.asarray(out).reshape(want.shape), want, rtol=2e-4, atol=2e-5)


def test_gradient_reaches_the_router_through_replayed_weights(moe32):
    block = moe32.layers[0]
    h = jax.random.normal(jax.random.key(1), (1, 2, block.config.hidden_size))
    routing = jnp.asarray([[[0, 1, 2], [5, 6, 7]]], jnp.int32)

    def loss(b):
        return jnp.sum(b.mlp(h, PLAIN, routing=routing)[0] ** 2)

    grads = nnx.jit(nnx.grad(loss))(block)  # one program: eager backward ops cost more
    assert float(jnp.abs(grads.router[...]).max()) > 0.0


def test_bad_routing_records_are_refused_naming_routing(moe32):
    """Refused on the host, before anything compiles."""
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    plen = np.array([2, 3])
    moe = moe32
    routing = np.zeros((2, 4, len(moe.routed_layers()), moe.config.num_experts_per_tok), np.int32)
    # another width, layer count, k; not integers
    bad = [routing[:, :-1], routing[:, :, :1], routing[..., :2], routing.astype(np.float32)]
    for record in bad:  # (the default mode: the check is the same, no calibration run)
        with pytest.raises(ValueError, match=r"routing must be an integer array of shape"):
            ll.token_logprobs(moe, ids, plen, routing=record, deterministic=False)
    high = routing.copy()
    high[1, 2, 0, 1] = moe.config.num_experts
    with pytest.raises(ValueError, match=r"routing\[1, 2, 0, 1\] = 8 is outside .*\[-1, 8\)"):
        ll.token_logprobs(moe, ids, plen, routing=high, deterministic=False)
    # a model that does not route: tests/rl/test_token_logprobs.py (its bad-input cases)


@pytest.mark.slow
def test_n_samples_on_shared_pages_record_and_replay(moe):
    """n = 2: each sample's record starts with its prompt's experts (prefilled once), and
    replaying the records gives the rollout's raw logprobs bit for bit."""
    params = ll.SamplingParams.create(3, temperature=1.0, max_tokens=6, seed=[1, 2, 3])
    gen = ll.generate(moe, PROMPTS, params, n=2, deterministic=True, ignore_eos=True,
                      return_routing=True)  # fmt: skip
    for r in range(0, 6, 2):
        width = len(PROMPTS[r // 2])
        np.testing.assert_array_equal(gen.routing[r][:width], gen.routing[r + 1][:width])
    ids, plen, lens, routing = _rows(gen)
    out = ll.token_logprobs(moe, ids, plen, lengths=lens, routing=routing)
    for r in range(len(ids)):
        got = np.asarray(out.raw_logprobs[r, plen[r] : lens[r]])
        want = np.asarray(gen.raw_logprobs[r], np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.slow
def test_token_logprobs_gradient_with_replay_reaches_the_router():
    """Through token_logprobs' custom VJP: forced experts change the values, and the
    router's gradient is finite and nonzero."""
    model = family_model("qwen3_moe", "float32")
    ids = np.array([[1, 5, 7, 9, 11, 30, 2, 40], [3, 4, 50, 51, 60, 0, 0, 0]], np.int32)
    plen, lens = np.array([4, 2]), np.array([8, 5])
    forced = np.broadcast_to(np.array([0, 1, 2], np.int32), (2, 8, 2, 3))

    def loss(m, routing):
        out = ll.token_logprobs(m, ids, plen, lengths=lens, routing=routing, deterministic=False)
        return jnp.sum(out.raw_logprobs)

    value, grads = nnx.value_and_grad(lambda m: loss(m, forced))(model)
    assert float(value) != float(loss(model, None))
    router = np.asarray(grads["layers"][0]["router"][...])
    assert np.all(np.isfinite(router)) and np.abs(router).max() > 0
