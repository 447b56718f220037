"""Phi-3's RoPE beyond the parity case: the short factors, the switch to the long ones, and
the options refused. The parity case (tiny_checkpoints "phi3") runs every row on the long
factors; here the original context (16) lies inside the prompts and the decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.models import config_from_hf, load_pretrained

from .tiny_checkpoints import (
    CASES,
    greedy_generate,
    jitted_forward,
    left_pad,
    random_prompts,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ORIGINAL = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    kwargs = dict(CASES["phi3"][2], original_max_position_embeddings=ORIGINAL)
    torch.manual_seed(1)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kwargs)).eval()
    folder = tmp_path_factory.mktemp("phi3")
    hf.save_pretrained(folder)
    model = load_pretrained(folder)
    return hf, model, jitted_forward(model)


def test_short_and_long_factors_per_row(pair):
    hf, model, forward = pair
    # 5 and 13 tokens stay within the original context (short factors); 20 go past it
    # (long factors for the whole prompt), each row as it would be alone.
    prompts = random_prompts(model.config.vocab_size, [5, 13, 20], seed=4)
    tokens, positions = left_pad(prompts, 24)
    logits, _ = forward(jnp.asarray(tokens), jnp.asarray(positions), model.init_cache(3, 32))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        np.testing.assert_allclose(np.asarray(logits[row]), want, rtol=0, atol=1e-4)


def test_decoding_across_the_switch_matches_hf_forward_with_a_cache(pair):
    # Past the original context each step uses the long factors while the cached keys keep
    # the rotation they were written with: transformers' forward with a cache does the
    # same. (Its generate() instead recomputes the whole sequence once, at the switch.)
    # Rows of 13 and 5 tokens cross during the 10 steps, the one of 20 started past it.
    hf, model, forward = pair
    prompts = random_prompts(model.config.vocab_size, [13, 5, 20], seed=5)
    ours = greedy_generate(model, prompts, 8, 24, forward)
    for row, prompt in enumerate(prompts):
        want, cache, ids = [], transformers.DynamicCache(config=hf.config), torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(8):
                out = hf(ids, cache=cache, use_cache=True)
                cache = out.cache
                ids = out.logits[:, -1].argmax(-1, keepdim=True)
                want.append(int(ids[0, 0]))
        assert ours[row].tolist() == want, f"row {row}"


PHI3 = dict(
    model_type="phi3",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=64,
    original_max_position_embeddings=16,
)
SU = dict(type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8)


def test_older_su_layout():
    config = config_from_hf(dict(PHI3, rope_theta=500.0, rope_scaling=SU))
    assert config.rope.rope_type == "longrope"
    assert config.rope.theta == 500.0
    assert config.rope.factor == 4.0
    assert config.rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(16)))
    assert config.rope.long_factor == (2.0,) * 8


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "unsupported RoPE type 'yarn'"),
        (dict(rope_scaling=dict(SU, short_factor=[1.0] * 3)), "short_factor has 3 entries"),
        (dict(rope_scaling=dict(SU, long_factor=None)), "requires a list 'long_factor'"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor = 1.5 must be in"),
    ],
)
def test_unsupported_phi3_options_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(dict(PHI3, **fields))
