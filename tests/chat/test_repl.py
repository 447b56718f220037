"""The interactive loop, driven by scripted input: replies streamed, the conversation kept,
/reset, /exit, and Ctrl-C ending a reply (or a line at the prompt) but not the loop."""

from __future__ import annotations

import dataclasses
import io

import pytest
import tokenizers

from logitloop.conversation import INTERRUPTED, PROMPT, ChatTemplate, repl

from .test_chat import CONVERSATION


class ScriptedInput:
    """readline() gives the lines in order; a KeyboardInterrupt entry is raised instead."""

    def __init__(self, lines):
        self.lines = list(lines)

    def readline(self) -> str:
        line = self.lines.pop(0) if self.lines else ""
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line


class InterruptingOutput(io.StringIO):
    """Raises KeyboardInterrupt once, at the second write after the `nth` prompt: Ctrl-C
    pressed while the reply to that prompt is streaming, after its first delta."""

    def __init__(self, nth: int):
        super().__init__()
        self.prompts, self.nth, self.after = 0, nth, None

    def write(self, text: str) -> int:
        if text == PROMPT:
            self.prompts += 1
            self.after = 0 if self.prompts == self.nth else None
        elif self.after is not None:
            self.after += 1
            if self.after == 2:
                self.after = None
                raise KeyboardInterrupt
        return super().write(text)


@dataclasses.dataclass(frozen=True)
class RecordingTemplate(ChatTemplate):
    """Records every conversation rendered for a reply."""

    calls: list = dataclasses.field(default_factory=list)

    def render(self, messages, *, add_generation_prompt=True, **kwargs):
        if add_generation_prompt:
            self.calls.append([dict(m) for m in messages])
        return super().render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def test_repl_keeps_the_conversation(scripted_chat):
    s = scripted_chat
    # Every prompt here renders to 33..64 tokens: one prompt bucket, compiled once.
    system, question = CONVERSATION[0]["content"], CONVERSATION[1]["content"]
    again = f"Again: {question}"
    lines = [f"{question}\n", "/reset\n", f"{again}\n", "Third\n", KeyboardInterrupt]
    stdin = ScriptedInput([*lines, "never read\n"])
    stdout = InterruptingOutput(nth=3)  # prompts: question, /reset, "Again"
    template = RecordingTemplate(s.template.source, s.template.special_tokens)
    knobs = {"temperature": 0, "max_tokens": 40}
    try:
        repl(s.model, knobs, input=stdin, output=stdout, system=system, chat_template=template)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the loop")

    reply = tokenizers.Tokenizer.from_file(s.tokenizer_json).decode(s.reply_ids)
    shown = stdout.getvalue().split(PROMPT)
    assert len(shown) == 6 and stdin.lines == ["never read\n"]  # Ctrl-C at the prompt left
    assert shown[1] == reply + "\n"
    assert shown[2] == "(new conversation)\n"
    partial, interrupted = shown[3].split(INTERRUPTED)
    assert partial and reply.startswith(partial) and partial != reply and interrupted == "\n"
    assert shown[4] == reply + "\n"
    assert shown[5] == "\n"
    first = {"role": "system", "content": system}
    user = [{"role": "user", "content": text} for text in (question, again, "Third")]
    assert template.calls == [
        [first, user[0]],
        [first, user[1]],  # after /reset: the system message stays
        [first, user[1], {"role": "assistant", "content": partial}, user[2]],
    ]


def test_repl_ends_at_exit_and_end_of_input(scripted_chat):
    s = scripted_chat
    for lines, rest in [(["/exit\n", "never read\n"], ["never read\n"]), ([], [])]:
        stdin, stdout = ScriptedInput(lines), io.StringIO()
        repl(s.model, {"temperature": 0}, input=stdin, output=stdout, chat_template=s.template)
        assert stdin.lines == rest
        assert stdout.getvalue().count(PROMPT) == 1
