"""Chat templates render as transformers' `apply_chat_template` renders them (text and ids),
in the styles of the common families; a template that refuses a conversation names it."""

from __future__ import annotations

import jinja2
import pytest

from logitloop.conversation import ChatTemplate
from logitloop.models import Tokenizer

from .folders import CHATML, GEMMA, LLAMA3, TOOLS, write_folder

transformers = pytest.importorskip("transformers")

# style -> (template, write_folder options)
STYLES = {
    "llama3": (LLAMA3, dict(bos="<|begin_of_text|>", eos="<|eot_id|>")),
    "chatml_file": (CHATML, dict(template_file=True, eos="<|im_end|>")),
    "gemma_named": (
        [{"name": "default", "template": GEMMA}, {"name": "tool_use", "template": TOOLS}],
        dict(bos="<bos>", eos="<eos>"),
    ),
    "tojson_loops": (TOOLS, dict(eos="<|endoftext|>")),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What does a with statement do?"}],
    [
        {"role": "system", "content": "  Answer briefly.  "},
        {"role": "user", "content": "naïve <b>café</b> & 日本語 🙂\n"},
        {"role": "assistant", "content": "It wraps a block.", "tool_calls": None},
        {"role": "user", "content": "And <|im_end|> as text?", "meta": {"z": [1, "ü"]}},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "reasoning": "think"},
        {"role": "user", "content": "STOP"},
        {"role": "assistant", "content": "after the break"},
    ],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: write_folder(root / name, template=t, **kw) for name, (t, kw) in STYLES.items()}


def _pair(folder):
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    return hf, ChatTemplate.from_folder(folder), Tokenizer.from_file(folder / "tokenizer.json")


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_text_and_ids_equal_transformers(folders, style, add_generation_prompt):
    hf, template, tokenizer = _pair(folders[style])
    for index, conversation in enumerate(CONVERSATIONS):
        if style == "gemma_named" and conversation[0]["role"] == "system":
            conversation = conversation[1:]
        want = hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        text = template.render(conversation, add_generation_prompt=add_generation_prompt)
        assert text == want, (style, index)
        want_ids = hf.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert tokenizer.encode(text, add_special_tokens=False) == want_ids, (style, index)


def test_bos_written_once(folders):
    hf, template, tokenizer = _pair(folders["llama3"])
    ids = tokenizer.encode(template.render(CONVERSATIONS[0]), add_special_tokens=False)
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1


def test_template_variables_reach_the_template(folders):
    hf, template, tokenizer = _pair(folders["tojson_loops"])
    tools = [{"name": "lookup", "description": "<find> a 'topic'", "parameters": {"b": 1, "a": 2}}]
    want = hf.apply_chat_template(CONVERSATIONS[1], tools=tools, tokenize=False)
    got = template.render(CONVERSATIONS[1], tools=tools, add_generation_prompt=False)
    assert got == want


def test_named_template_choice(folders):
    hf, _, _ = _pair(folders["gemma_named"])
    other = ChatTemplate.from_folder(folders["gemma_named"], name="tool_use")
    want = hf.apply_chat_template(CONVERSATIONS[0], chat_template="tool_use", tokenize=False)
    assert other.render(CONVERSATIONS[0], add_generation_prompt=False) == want
    with pytest.raises(ValueError, match=r"no chat template named 'nope'.*'default', 'tool_use'"):
        ChatTemplate.from_folder(folders["gemma_named"], name="nope")


@pytest.mark.parametrize(
    ("conversation", "culprit", "reason"),
    [
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], 0, "System role"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": "c"},
            ],
            2,
            "roles must alternate",
        ),
    ],
)
def test_refusal_names_conversation_and_message(folders, conversation, culprit, reason):
    hf, template, _ = _pair(folders["gemma_named"])
    with pytest.raises(jinja2.TemplateError, match=reason):
        hf.apply_chat_template(conversation, tokenize=False)
    role = conversation[culprit]["role"]
    with pytest.raises(
        ValueError,
        match=rf"conversations\[4\], messages\[{culprit}\] \(role '{role}'\).*{reason}",
    ):
        template.render(conversation, where="conversations[4]")


def test_end_of_turn_token(folders):
    for style, name in [
        ("llama3", "<|eot_id|>"),
        ("chatml_file", "<|im_end|>"),
        ("gemma_named", "<end_of_turn>"),
        ("tojson_loops", None),
    ]:
        hf, template, tokenizer = _pair(folders[style])
        want = None if name is None else hf.convert_tokens_to_ids(name)
        assert template.end_of_turn_token(tokenizer) == want, style


def test_folder_without_template(tmp_path):
    folder = write_folder(tmp_path / "plain", template=None)
    with pytest.raises(ValueError, match="has no chat template.*generate works without it"):
        ChatTemplate.from_folder(folder)
