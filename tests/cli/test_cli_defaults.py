"""`logitloop generate`'s defaults: a fresh seed per run written into every record, top
logprobs with their token text, `max_new_tokens` as a flag and a JSONL key, `--stream`
with several prompts and `-n`. In process; the runs on the shipped model are `-m slow`."""

from __future__ import annotations

import json

import numpy as np
import pytest

import logitloop as ll
from logitloop.cli import main, run_generate
from logitloop.cli.common import CLIError
from logitloop.cli.parser import build_parser
from logitloop.cli.run_stream import stream_items
from logitloop.jobs.items import Item, read_items, record, row_params
from logitloop.jobs.sinks import TextOutput
from logitloop.models.loading import SHIPPED_MODEL_DIR
from logitloop.models.tokenizer import Tokenizer
from tests.decoding.scripted import make_model


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(SHIPPED_MODEL_DIR / "tokenizer.json")


def _job(monkeypatch, *flags):
    """`generate`'s settings for `flags`, up to the model: its items and the seed it drew
    (None with --seed), which the job's last line on stderr names."""
    got = {}

    def stop_before_the_model(args, items, todo, *rest):
        got["items"], got["seed"] = items, rest[-1]
        return 0

    monkeypatch.setattr(run_generate, "_run_job", stop_before_the_model)
    assert run_generate.run(build_parser().parse_args(["generate", "a", "b", *flags])) == 0
    return got["items"], got["seed"]


def test_each_run_draws_its_seed(monkeypatch):
    first, seed = _job(monkeypatch)
    assert isinstance(seed, int) and [it.knobs["seed"] for it in first] == [seed, seed]
    _, second = _job(monkeypatch)
    assert second != seed  # equal once in 2**31 runs
    given, drawn = _job(monkeypatch, "--seed", "7")
    assert [it.knobs["seed"] for it in given] == [7, 7] and drawn is None


def _result(text, top):
    return ll.GenerationResult(
        token_ids=[[int(t) for t in top]],
        finish_reason=["length"],
        stop_reason=[None],
        num_tokens=[len(top)],
        prompt_token_ids=[[1]],
        logprobs=[[-1.0] * len(top)],
        raw_logprobs=[[-1.0] * len(top)],
        top_logprobs=[[{int(t): -0.5, int(t) + 1: -1.5} for t in top]],
        text=text,
        error=[None],
    )


def test_records_hold_the_seed_and_top_logprobs_with_token_text(tokenizer):
    top = np.random.default_rng().integers(0, tokenizer.vocab_size - 1, size=3)
    item = Item(0, "prompt 0", "a", {"seed": 11, "logprobs": 2}, 0)
    rec = record(item, _result("xyz", top), 1, tokenizer)
    assert rec["seed"] == 11 and rec["text"] == "xyz"
    for t, alternatives in zip(top, rec["top_logprobs"], strict=True):
        assert alternatives == [
            [int(t), -0.5, tokenizer.decode([int(t)], skip_special_tokens=False)],
            [int(t) + 1, -1.5, tokenizer.decode([int(t) + 1], skip_special_tokens=False)],
        ]


def test_jsonl_lines_take_max_new_tokens(tmp_path):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "b"}\n')
    items = read_items(str(lines), {"max_tokens": 5}, run_generate.param_defaults())
    assert [it.knobs["max_tokens"] for it in items] == [2, 5]  # the line's replaces the flag's
    assert "max_new_tokens" not in items[0].knobs
    lines.write_text('{"prompt": "a", "max_new_tokens": 2, "max_tokens": 4}\n')
    with pytest.raises(CLIError, match="line 1: max_tokens = 4 and its alias max_new_tokens"):
        read_items(str(lines), {}, run_generate.param_defaults())


def test_max_new_tokens_flag_is_max_tokens():
    for command, prompt in (("generate", ["a"]), ("chat", [])):
        assert build_parser().parse_args([command, *prompt]).max_tokens is None
        args = build_parser().parse_args([command, "--max-new-tokens", "5", *prompt])
        assert args.max_tokens == 5


def test_stream_prints_what_the_batch_run_prints(tokenizer, capsys):
    """Two prompts, n = 2, a batch each: the streamed blocks equal the printed records."""
    vocab = tokenizer.vocab_size
    table = np.random.default_rng().integers(0, vocab, size=(vocab, 64))
    model = make_model(table, tokenizer=tokenizer)
    rng = np.random.default_rng()
    items = []
    for i in range(2):
        knobs = {"temperature": 1.5, "seed": int(rng.integers(100)), "max_tokens": 6}
        item = Item(f"p{i}", f"prompt {i}", None, knobs, i, params=row_params(knobs))
        item.token_ids = rng.integers(0, vocab, size=int(rng.integers(1, 5))).tolist()
        items.append(item)
    stream_items(model, items, TextOutput(headers=True), n=2, batch_size=1, ignore_eos=True)
    streamed = capsys.readouterr().out
    # ll.generate runs the programs ll.stream ran: nothing compiles again
    results = [ll.generate(model, [it.token_ids], it.params, n=2, ignore_eos=True) for it in items]
    records = [record(it, r, 2) for it, r in zip(items, results, strict=True)]
    TextOutput(headers=True).write(records, 2)
    assert streamed == capsys.readouterr().out
    assert streamed.count("==> ") == 4


FLAGS = ["--max-tokens", "3", "--no-compile-cache", "-q"]


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["generate", *args, *FLAGS])
    out, err = capsys.readouterr()
    return status, out, err


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
def test_a_recorded_seed_reproduces_the_run(tmp_path, capsys):
    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    status = main(["generate", "The for", "x =", "-o", str(first), *FLAGS[:-1]])  # not -q
    err = capsys.readouterr().err
    assert status == 0, err
    seed = _records(first)[0]["seed"]
    assert f"seed {seed} (drawn for this run; --seed {seed} repeats it)" in err
    status, _, err = _generate(capsys, "The for", "x =", "-o", str(again), "--seed", str(seed))
    assert status == 0, err
    assert _records(again) == _records(first)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_stream_prints_what_the_plain_run_prints_on_the_shipped_model(capsys, n):
    args = ["The for", "x =", "-n", str(n), "--seed", "5", "--temperature", "1.5"]
    status, plain, err = _generate(capsys, *args)
    assert status == 0, err
    status, streamed, err = _generate(capsys, *args, "--stream")
    assert status == 0, err
    assert streamed == plain and plain.count("==> ") == 2 * n
