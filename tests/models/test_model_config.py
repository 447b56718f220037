"""`config_from_hf` on config.json layouts the tiny `transformers` models do not write."""

from __future__ import annotations

import pytest

from logitloop.models import GPT2Config, LlamaConfig, RopeConfig, config_from_hf

LLAMA = dict(
    model_type="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def test_older_rope_layout_with_type_key():
    # transformers 4.x: rope_theta at top level, rope_scaling with "type".
    config = config_from_hf(
        dict(LLAMA, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert config.rope == RopeConfig(rope_type="linear", theta=500000.0, factor=2.0)
    assert config.num_kv_heads == 4  # absent: plain multi-head attention
    assert config.head_dim == 4


def test_qwen2_window_only_with_use_sliding_window():
    qwen = dict(LLAMA, model_type="qwen2", sliding_window=8, max_window_layers=1)
    assert config_from_hf(qwen).sliding_windows == (None, None, None)
    assert config_from_hf(dict(qwen, use_sliding_window=True)).sliding_windows == (None, 8, 8)
    assert config_from_hf(qwen).qkv_bias and not config_from_hf(qwen).o_bias


def test_mistral_window_on_every_layer_and_llama_never():
    mistral = config_from_hf(dict(LLAMA, model_type="mistral", sliding_window=8))
    assert mistral.sliding_windows == (8, 8, 8)
    assert config_from_hf(dict(LLAMA, sliding_window=8)).sliding_windows == (None, None, None)


def test_generation_config_ids_take_precedence():
    config = config_from_hf(
        dict(LLAMA, eos_token_id=2, bos_token_id=1),
        generation_config={"eos_token_id": [2, 7], "bos_token_id": None},
    )
    assert config.eos_token_id == (2, 7)
    assert config.bos_token_id == 1
    assert config_from_hf(dict(LLAMA, eos_token_id=None)).eos_token_id == ()


def test_gpt2_fields():
    config = config_from_hf(
        dict(model_type="gpt2", vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    )
    assert isinstance(config, GPT2Config)
    assert config.intermediate_size == 64
    assert config.hidden_act == "gelu_new"


def test_configs_are_hashable():
    # They sit in the GraphDef that jax.jit takes as a static argument.
    assert hash(config_from_hf(LLAMA)) == hash(config_from_hf(dict(LLAMA)))
    assert isinstance(config_from_hf(LLAMA), LlamaConfig)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="falcon"), "model_type 'falcon'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE type 'yarn'"),
        (dict(hidden_act="swish_glu"), "activation 'swish_glu'"),
        (dict(hidden_size=None), "'hidden_size'"),
    ],
)
def test_unsupported_configs_name_the_file(change, message):
    with pytest.raises(ValueError, match=f"ckpt/config.json.*{message}"):
        config_from_hf(dict(LLAMA, **change), source="ckpt/config.json")


@pytest.mark.parametrize("cap", [0, -30.0, "30", float("inf"), True])
def test_a_soft_cap_is_null_or_positive(cap):
    """A cap of 0 divided every logit by zero (NaN, without a word); "30" crashed float()."""
    gemma = dict(LLAMA, num_hidden_layers=2, model_type="gemma2")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        with pytest.raises(ValueError, match=rf"ckpt/config.json: {key} = .* must be null"):
            config_from_hf(dict(gemma, **{key: cap}), source="ckpt/config.json")
    assert config_from_hf(dict(gemma, final_logit_softcapping=30)).final_logit_softcapping == 30.0


# Model folders with bad fields: (config.json changes, generation_config.json or None, the
# file the message must name, the text it must hold). Loaded with load_pretrained from a
# folder that holds only the two files: the check comes before any weight is read.
BAD_FOLDERS = [
    ({}, {"eos_token_id": [[0]]}, "generation_config.json", "eos_token_id = [[0]] must be"),
    ({}, {"eos_token_id": "x"}, "generation_config.json", "eos_token_id = 'x' must be"),
    ({}, {"eos_token_id": 0.7}, "generation_config.json", "eos_token_id = 0.7 must be"),
    ({}, {"eos_token_id": -1}, "generation_config.json", "holds -1, outside the vocabulary"),
    (
        {},
        {"eos_token_id": 99999},
        "generation_config.json",
        "holds 99999, outside the vocabulary range [0, 31]",
    ),
    ({}, {"eos_token_id": [2, True]}, "generation_config.json", "eos_token_id = [2, True]"),
    ({}, {"bos_token_id": [1]}, "generation_config.json", "bos_token_id = [1] must be"),
    ({"eos_token_id": 40}, None, "config.json", "eos_token_id = 40 holds 40"),
    ({"vocab_size": -5}, None, "config.json", "vocab_size = -5 must be a positive integer"),
    ({"vocab_size": "big"}, None, "config.json", "vocab_size = 'big' must be a positive"),
    (
        {"max_position_embeddings": 0},
        None,
        "config.json",
        "max_position_embeddings = 0 must be a positive integer",
    ),
    ({"num_hidden_layers": 2.5}, None, "config.json", "num_hidden_layers = 2.5"),
    ({"num_attention_heads": True}, None, "config.json", "num_attention_heads = True"),
]


@pytest.mark.parametrize(
    "change, generation, file, message",
    BAD_FOLDERS,
    ids=[f"folder-{i}" for i in range(len(BAD_FOLDERS))],
)
def test_bad_fields_in_a_model_folder_name_the_file_and_field(
    change, generation, file, message, tmp_path
):
    import json

    from logitloop.models import load_pretrained

    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, **change)))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path)
    text = str(err.value)
    assert text.startswith(str(tmp_path / file) + ": ") and message in text, text


def test_generation_config_overrides_a_bad_config_id():
    config = config_from_hf(dict(LLAMA, eos_token_id=[3]), generation_config={"eos_token_id": 5})
    assert config.eos_token_id == (5,)


def test_new_family_configs_survive_a_json_round_trip():
    # save_converted writes config_to_dict as JSON; restore rebuilds it by model_type.
    import json

    from logitloop.models.config import config_from_dict, config_to_dict

    small = dict(LLAMA, num_hidden_layers=2, sliding_window=4)
    su = {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    configs = [
        config_from_hf(dict(small, model_type="gemma2", final_logit_softcapping=30.0)),
        config_from_hf(dict(small, model_type="gemma3_text", rope_local_base_freq=100.0)),
        config_from_hf(
            dict(small, model_type="phi3", rope_scaling=su, original_max_position_embeddings=8)
        ),
        config_from_hf(
            dict(
                small,
                model_type="qwen3_moe",
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                mlp_only_layers=[0],
            )
        ),
    ]
    for config in configs:
        again = config_from_dict(json.loads(json.dumps(config_to_dict(config))))
        assert again == config and type(again) is type(config)
