"""Conversations on the command line: JSONL `messages` lines (rendered with the model's chat
template, resumed like any job), the checkpoint's generation defaults, and `logitloop chat`
driven through a pseudo-terminal (a question and its reply, the conversation kept, /reset,
Ctrl-C during a reply, Ctrl-C and Ctrl-D at the prompt)."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from logitloop.models.loading import SHIPPED_MODEL_DIR

from .test_cli import cli_env, compile_cache, read_jsonl, run_cli  # noqa: F401 -- compile_cache: autouse

QUESTION = "The for statement"
FOLLOW_UP = "Tell me about the while statement."
GREEDY = ["--temperature", "0", "--max-tokens", "48", "--seed", "0"]  # records equal run to run


def _folder(model_args: list[str]) -> Path:
    return Path(model_args[1]) if model_args else SHIPPED_MODEL_DIR


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def chat_job(tmp_path_factory, model_args):
    """A job of conversations beside the same conversations as token ids rendered by
    transformers' apply_chat_template (stopping at the same ids), run once uninterrupted."""
    transformers = pytest.importorskip("transformers")
    folder = _folder(model_args)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    first = [_user(QUESTION)]
    lines = [{"id": "q1", "messages": first}, {"id": "plain", "prompt": "A dictionary"}]
    for i, messages in enumerate([first, [{"role": "system", "content": "Be brief."}, *first]]):
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        lines.append({"id": f"hf{i}", "prompt_token_ids": ids, "stop_token_ids": stops})
    lines.append({"id": "system", "messages": [{"role": "system", "content": "Be brief."}, *first]})
    path = tmp_path_factory.mktemp("chat_cli") / "chats.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = path.parent / "clean.jsonl"
    args = ["generate", "-i", str(path), "-o", str(out), "--batch-size", "2", *GREEDY]
    proc = run_cli(*args, *model_args)
    assert proc.returncode == 0, proc.stderr
    return path, out, [*args, *model_args], {r["id"]: r for r in read_jsonl(out)}


def test_messages_lines_are_the_model_s_template(chat_job):
    _, _, _, records = chat_job
    for mine, reference in [("q1", "hf0"), ("system", "hf1")]:
        got, want = records[mine], records[reference]
        assert "prompt" not in got and got["messages"][-1] == _user(QUESTION)
        for key in ("text", "token_ids", "finish_reason", "stop_reason"):
            assert got[key] == want[key], (mine, key)
    assert records["plain"]["prompt"] == "A dictionary"


def test_messages_reply_ends_at_the_end_of_turn(chat_job, model_args):
    if model_args:
        pytest.skip("the shipped model's reply to its own question")
    _, _, _, records = chat_job
    end_of_turn = json.loads((SHIPPED_MODEL_DIR / "generation_config.json").read_text())
    got = records["q1"]
    assert got["finish_reason"] == "stop" and got["stop_reason"] in end_of_turn["eos_token_id"]
    assert got["stop_reason"] not in got["token_ids"][:-1] and got["text"].strip()
    assert "<|im_end|>" not in got["text"]


def test_messages_stop_at_the_template_s_end_of_turn(chat_job, model_args, tmp_path):
    """A checkpoint whose EOS ids leave out the end-of-turn token: a conversation still
    stops there (the template's), a plain prompt does not."""
    if model_args:
        pytest.skip("the shipped model's reply to its own question")
    _, _, _, records = chat_job
    folder = tmp_path / "model"
    shutil.copytree(SHIPPED_MODEL_DIR, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    end_of_turn = config["eos_token_id"].pop()  # <|im_end|>
    (folder / "generation_config.json").write_text(json.dumps(config))
    path = tmp_path / "chats.jsonl"
    lines = [{"messages": [_user(QUESTION)]}, {"prompt_token_ids": records["hf0"]["prompt"]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "-i", str(path), "-o", str(out), *GREEDY, "--model", str(folder))
    assert proc.returncode == 0, proc.stderr
    chat, plain = read_jsonl(out)
    assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", end_of_turn)
    assert chat["token_ids"] == records["q1"]["token_ids"]
    n = chat["num_tokens"]  # the same rendered ids as a plain prompt run on past the turn
    assert plain["token_ids"][:n] == chat["token_ids"] and plain["num_tokens"] > n


def test_messages_job_resumes(chat_job):
    path, clean, args, records = chat_job
    out = path.parent / "resumed.jsonl"
    done = clean.read_text(encoding="utf-8").splitlines(keepends=True)[:2]
    out.write_text("".join(done) + '{"id": "half a li', encoding="utf-8")  # as a kill leaves
    proc = run_cli(*[str(out) if a == str(clean) else a for a in args])
    assert proc.returncode == 0, proc.stderr
    assert "partial last line" in proc.stderr and "2 already in" in proc.stderr
    assert read_jsonl(out) == read_jsonl(clean)


BAD_LINES = {
    "both": ('{"prompt": "a", "messages": []}', "line 2: give exactly one of 'prompt', "),
    "neither": ('{"temperature": 0}', "line 2: give exactly one of 'prompt', "),
    "not-a-message": ('{"messages": ["hi"]}', 'line 2: messages[0] = "hi" is not a message'),
    "template-refuses": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "user"}]}',
        "line 2, messages[1] (role 'user'): the chat template",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_messages_line_is_named(case, model_args, tmp_path):
    line, expected = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    proc = run_cli("generate", "-i", str(path), "--max-tokens", "2", *model_args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("logitloop: error: ") and proc.stderr.count("\n") == 1
    assert f"{path} {expected}" in proc.stderr, proc.stderr


def test_generation_defaults_are_used_and_shown(model_args, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(_folder(model_args), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(max_new_tokens=3, top_k=7)
    (folder / "generation_config.json").write_text(json.dumps(config))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": 0, "prompt": "A"}\n{"id": 1, "prompt": "B", "max_tokens": 5}\n')
    got = {}
    for mode in ("auto", "none"):
        out = tmp_path / f"{mode}.jsonl"
        proc = run_cli(
            "generate", "-i", str(jobs), "-o", str(out), "--ignore-eos", "--top-k", "9",
            "--model", str(folder), "--generation-config", mode,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        got[mode] = [r["num_tokens"] for r in read_jsonl(out)], proc.stderr
    assert got["auto"][0] == [3, 5] and got["none"][0] == [16, 5]  # file, line; create's 16
    shown = f"sampling defaults from {folder / 'generation_config.json'}: top_k=7, max_tokens=3"
    assert shown in got["auto"][1] and "sampling defaults" not in got["none"][1]


# ------------------------------------------------------------------ the terminal


class Terminal:
    """`logitloop chat` on a pseudo-terminal that is its controlling terminal, so that
    typing Ctrl-C (\\x03) sends SIGINT to it as a real terminal does."""

    def __init__(self, *args: str):
        master, slave = os.openpty()

        def own_terminal():  # runs in the child: a new session whose terminal is the pty
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "logitloop", "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**cli_env(), "TERM": "dumb"},
            preexec_fn=own_terminal,
        )
        os.close(slave)
        self.fd, self.seen = master, ""

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def read_some(self, timeout: float = 1.0) -> None:
        """Add what the terminal shows within `timeout` seconds to `seen` (\r\n as \n)."""
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the child closed the terminal
                chunk = b""
            assert chunk, f"the terminal closed after {self.seen[-2000:]!r}"
            self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")

    def read_until(self, want: str, timeout: float = 300) -> str:
        """Everything shown up to and including the first `want` after the last read."""
        deadline = time.monotonic() + timeout
        while want not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {want!r} in {self.seen[-2000:]!r}"
            self.read_some(min(left, 1.0))
        at = self.seen.index(want) + len(want)
        shown, self.seen = self.seen[:at], self.seen[at:]
        return shown

    @staticmethod
    def _echo_removed(shown: str, line: str) -> str:
        # The line editor echoes a line typed, and so does the terminal itself when the line
        # came before the editor had it in raw mode.
        for _ in range(2):
            shown = shown.removeprefix(line + "\n")
        return shown

    def without_echo(self, line: str) -> str:
        """What was shown since the last read, less the echo of `line`."""
        return self._echo_removed(self.seen, line)

    def say(self, line: str) -> str:
        """Type a line; what the program shows in answer, up to its next prompt."""
        self.type(line + "\n")
        return self._echo_removed(self.read_until("\n> ").removesuffix("> "), line)

    def leave(self, key: str) -> int:
        """Type `key` at the prompt until the program ends (a key typed before the line
        editor has the terminal in raw mode may be taken by the line discipline: Ctrl-D as
        the end of a read nobody was doing); its exit status."""
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.type(key)
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return self.close()

    def close(self) -> int | None:
        """Ends the program if it still runs; its exit status (None: it had to be killed)."""
        status = self.proc.poll()
        if status is None:
            self.proc.kill()
            self.proc.wait()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return status


def test_chat_on_a_terminal(chat_job, model_args):
    """A question and its reply (the JSONL job's, as the model's template renders it), a
    follow-up with the conversation kept, /reset, the question again, Ctrl-D."""
    _, _, _, records = chat_job
    reply = records["q1"]["text"]
    term = Terminal(*GREEDY, *model_args)
    try:
        term.read_until("Ctrl-C during a reply ends it)\n> ")
        assert term.say(QUESTION) == reply + "\n"
        follow_up = term.say(FOLLOW_UP).removesuffix("\n")
        assert term.say("/reset") == "(new conversation)\n"
        assert term.say(QUESTION) == reply + "\n"
        assert term.leave("\x04") == 0  # Ctrl-D
    finally:
        term.close()
    # the follow-up saw the first turn: it is the reply to the whole conversation
    conversation = [_user(QUESTION), {"role": "assistant", "content": reply}, _user(FOLLOW_UP)]
    path = Path(chat_job[0]).parent / "follow_up.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n", encoding="utf-8")
    proc = run_cli("generate", "-i", str(path), "-o", str(path.with_suffix(".out")), *GREEDY,
                   *model_args)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert follow_up == read_jsonl(path.with_suffix(".out"))[0]["text"]


def test_ctrl_c_ends_a_reply_not_the_chat(model_args):
    """A reply that would run for 900 tokens, Ctrl-C after its first text: the reply stops,
    marked, the prompt comes back; Ctrl-C at the prompt then leaves with status 0."""
    term = Terminal("--temperature", "0", "--ignore-eos", "--max-tokens", "900", *model_args)
    try:
        term.read_until("Ctrl-C during a reply ends it)\n> ")
        term.type(QUESTION + "\n")
        term.type(QUESTION + "\n")
        deadline = time.monotonic() + 300
        while len(term.without_echo(QUESTION)) < 8:  # until the reply has begun
            assert time.monotonic() < deadline, "no reply"
            term.read_some()
        term.type("\x03")  # Ctrl-C
        partial = term.read_until(" [interrupted]\n> ")
        assert 8 <= len(Terminal._echo_removed(partial, QUESTION)) < 3000  # not 900 tokens
        assert term.leave("\x03") == 0  # Ctrl-C at the prompt
    finally:
        term.close()
