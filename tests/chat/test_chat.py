"""ll.chat and ll.stream_chat: replies end at the end-of-turn token, the checkpoint's template
and generation defaults are found from its folder, bad conversations are named."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import tokenizers

import logitloop as ll
from logitloop.conversation import chat_request, end_of_turn_ids
from logitloop.decoding.sampling.params import generation_defaults

from .conftest import EOT, GENERATION_CONFIG, IM_END

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does a with statement do?"},
]


def _decode(tokenizer_json: str, ids: list[int]) -> str:
    return tokenizers.Tokenizer.from_file(tokenizer_json).decode(ids)


def test_reply_ends_at_end_of_turn(scripted_chat):
    transformers = pytest.importorskip("transformers")
    s = scripted_chat
    params = ll.SamplingParams.create(1, temperature=0, max_tokens=40)
    result = ll.chat(s.model, [CONVERSATION], params, chat_template=s.template)
    assert result.token_ids[0] == [*s.reply_ids, IM_END]
    assert (result.finish_reason[0], result.stop_reason[0]) == ("stop", IM_END)
    assert result.text[0] == _decode(s.tokenizer_json, s.reply_ids)
    # the prompt is the conversation as transformers renders and tokenizes it
    hf = transformers.AutoTokenizer.from_pretrained(Path(s.tokenizer_json).parent)
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert result.prompt_token_ids[0] == want


def test_stream_chat_ends_at_end_of_turn(scripted_chat):
    s = scripted_chat
    params = ll.SamplingParams.create(temperature=0, max_tokens=40)  # one row for any batch
    events = list(ll.stream_chat(s.model, [CONVERSATION], params, chat_template=s.template))
    assert "".join(e.text for e in events) == _decode(s.tokenizer_json, s.reply_ids)
    assert [t for e in events for t in e.token_ids] == [*s.reply_ids, IM_END]
    assert (events[-1].finish_reason, events[-1].stop_reason) == ("stop", IM_END)


def test_ignore_eos_runs_past_the_end_of_turn(scripted_chat):
    s = scripted_chat
    params = ll.SamplingParams.create(1, temperature=0, max_tokens=len(s.reply_ids) + 3)
    result = ll.chat(s.model, [CONVERSATION], params, chat_template=s.template, ignore_eos=True)
    assert result.token_ids[0][: len(s.reply_ids) + 1] == [*s.reply_ids, IM_END]
    assert result.finish_reason[0] == "length"
    assert result.num_tokens[0] == len(s.reply_ids) + 3


def test_end_of_turn_ids_from_the_folder(chat_model):
    # generation_config.json's eos_token_id list, and the template's <|eot_id|>
    assert set(end_of_turn_ids(chat_model)) == {*GENERATION_CONFIG["eos_token_id"], EOT}


def test_chat_request_for_a_jsonl_line(chat_model, chat_folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(chat_folder)
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    ends = [*GENERATION_CONFIG["eos_token_id"], EOT]
    for stops, want_stops in [(None, ends), (7, [7, *ends]), ([[7, 0]], [7, 0, 3, EOT])]:
        ids, knobs = chat_request(chat_model, CONVERSATION, {"stop_token_ids": stops, "seed": 1})
        assert ids == want
        assert knobs == {"stop_token_ids": want_stops, "seed": 1}


def test_chat_needs_a_template(chat_folder, tmp_path, scripted_chat):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(chat_folder / name, tmp_path / name)
    config = json.loads((chat_folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    model = ll.load_pretrained(tmp_path)  # loads, and generate needs no template
    with pytest.raises(ValueError, match="has no chat template.*generate works without it"):
        ll.chat(model, [CONVERSATION])
    with pytest.raises(ValueError, match="not loaded from a checkpoint folder"):
        ll.chat(scripted_chat.model, [CONVERSATION])


def test_bad_conversations_are_named(scripted_chat):
    s = scripted_chat
    with pytest.raises(ValueError, match=r"one conversation .*pass a list of conversations"):
        ll.chat(s.model, CONVERSATION, chat_template=s.template)
    with pytest.raises(ValueError, match=r"conversations\[1\], messages\[0\] = .*'role' string"):
        ll.chat(s.model, [CONVERSATION, [{"content": "hi"}]], chat_template=s.template)


def _defaults_of(tmp_path, generation_config):
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return types.SimpleNamespace(checkpoint_dir=tmp_path)  # all generation_defaults reads


def test_generation_defaults(chat_model, tmp_path):
    assert generation_defaults(chat_model) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 24,
    }
    greedy = _defaults_of(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": None})
    assert generation_defaults(greedy) == {"temperature": 0.0}


def test_from_model_overrides_win(chat_model, scripted_chat):
    params = ll.SamplingParams.from_model(chat_model, 2, top_p=0.5, seed=[1, 2])
    got = {k: np.asarray(getattr(params, k)).tolist() for k in ("top_k", "max_tokens", "seed")}
    assert got == {"top_k": [20, 20], "max_tokens": [24, 24], "seed": [1, 2]}
    for name, want in [
        ("temperature", 0.6),
        ("top_p", 0.5),
        ("min_p", 0.05),
        ("repetition_penalty", 1.1),
    ]:
        np.testing.assert_array_equal(getattr(params, name), np.float32([want, want]), name)
    # no folder: create's own defaults
    plain = ll.SamplingParams.from_model(scripted_chat.model, 1)
    assert float(plain.temperature[0]) == 1.0 and int(plain.max_tokens[0]) == 16


def test_bad_generation_config_names_the_file(tmp_path):
    bad = _defaults_of(tmp_path, {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p = 1.5"):
        ll.SamplingParams.from_model(bad, 1)
