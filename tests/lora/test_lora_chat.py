"""`logitloop chat --adapter NAME=PATH --use-adapter NAME` (issue 71): the conversation
runs under the adapter, its reply `ll.chat`'s under the same adapter loaded by
`ll.load_adapter` (and not the base model's); adapter flags are checked before the model
loads."""

from __future__ import annotations

import io

import logitloop as ll
from logitloop.cli import main
from logitloop.conversation import HELP, PROMPT

from .peft_adapters import shipped_model_adapter

QUESTION = "The for statement"
FLAGS = ["--temperature", "0", "--max-tokens", "8", "--seed", "0"]


def _reply(out: str) -> str:
    """The first reply of a chat session's output: after the help line and the prompt,
    up to the next prompt."""
    body = out[len(f"({HELP})\n") + len(PROMPT) :]
    return body[: body.rindex("\n" + PROMPT)]


def test_chat_runs_under_the_adapter(tmp_path, monkeypatch, capsys):
    folder = shipped_model_adapter(tmp_path / "up8", seed=0)
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION + "\n"))
    status = main(["chat", *FLAGS, "--adapter", f"up8={folder}", "--use-adapter", "up8"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    model = ll.load_pretrained()
    table = ll.load_adapter(model, folder, name="up8")
    conversation = [{"role": "user", "content": QUESTION}]
    want = ll.chat(
        model, [conversation] * 2, temperature=0, max_tokens=8, seed=0, adapters=table,
        adapter=["up8", None],
    )  # fmt: skip
    assert _reply(captured.out) == want.text[0] != want.text[1]


def test_chat_adapter_flags_are_checked_before_the_model_loads(capsys):
    cases = [
        (["--adapter", "a=x", "--use-adapter", "b"], "no --adapter b=PATH loads it"),
        (["--adapter", "a=x", "--adapter", "a=y"], "the name 'a' is given twice"),
    ]
    for flags, message in cases:
        assert main(["chat", *flags]) == 2
        assert message in capsys.readouterr().err
