"""Gemma beyond the parity cases: config.json layouts the tiny models do not write, the
options refused, and the language model of a multimodal gemma3 checkpoint."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.models import GemmaConfig, RopeConfig, config_from_hf, load_pretrained

GEMMA = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=7,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=4,
)


def test_gemma2_defaults_alternate_local_and_global_layers():
    config = config_from_hf(dict(GEMMA, model_type="gemma2", rope_theta=10000.0))
    assert isinstance(config, GemmaConfig)
    assert config.sliding_windows == (4, None, 4, None, 4, None, 4)
    assert config.rope == config.local_rope == RopeConfig(theta=10000.0)
    assert config.tie_word_embeddings and not config.qk_norm
    assert config.query_pre_attn_scalar == 256.0
    assert config.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_older_layout_pattern_and_local_rope_base():
    # transformers 4.x: no layer_types, sliding_window_pattern, rope_local_base_freq.
    config = config_from_hf(
        dict(
            GEMMA,
            model_type="gemma3_text",
            sliding_window_pattern=6,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            query_pre_attn_scalar=8,
            final_logit_softcapping=None,
        )
    )
    assert config.sliding_windows == (4, 4, 4, 4, 4, None, 4)
    assert config.rope == RopeConfig(rope_type="linear", theta=1e6, factor=8.0)
    assert config.local_rope == RopeConfig(theta=1e4)
    assert config.qk_norm and config.final_logit_softcapping is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(layer_types=["chunked_attention"] * 7), "layer_types entry 'chunked_attention'"),
        (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 7 layers"),
        (dict(hidden_activation="swish"), "unsupported activation 'swish'"),
    ],
)
def test_unsupported_gemma_options_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(dict(GEMMA, model_type="gemma3_text", **fields))


@pytest.mark.slow  # ~10 s: imports and builds the vision tower too
def test_multimodal_gemma3_loads_its_language_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from .tiny_checkpoints import CASES, jitted_forward

    text = dict(CASES["gemma3_text"][2], num_hidden_layers=2)
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=150,
        boi_token_index=151,
        eoi_token_index=152,
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert model.config.model_type == "gemma3"
    assert model.config.sliding_windows == (5, None)
    prompt = [5, 9, 33, 44, 12, 100, 7, 8]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    forward = jitted_forward(model)
    got, _ = forward(jnp.asarray([prompt]), jnp.arange(len(prompt))[None], model.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0, atol=1e-4)
