"""`logitloop score` and `logitloop generate --num-beams`, run in-process on the shipped model."""

from __future__ import annotations

import json
import re

import pytest

import logitloop as ll
from logitloop.cli import main

PAIRS = [
    {"id": "a", "prompt": "The quick brown fox ", "continuation": "jumps over the lazy dog."},
    {"id": "b", "prompt": "Question: 2+2=", "continuation": " 4"},
    {"prompt_token_ids": [5, 6, 7], "continuation_token_ids": [8, 9]},
]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_score_writes_lines_in_order_and_resumes(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = tmp_path / "scores.jsonl"
    args = ["score", "--input", str(pairs), "--output", str(out), "--top-logprobs", "2", "-q"]
    assert main(args) == 0
    got = _lines(out)
    assert [g["id"] for g in got] == ["a", "b", 2]
    want = ll.score(
        ll.load_pretrained(), [p.get("prompt", p.get("prompt_token_ids")) for p in PAIRS],
        [p.get("continuation", p.get("continuation_token_ids")) for p in PAIRS], top_logprobs=2,
        deterministic=True,  # a job written to --output is deterministic by default
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w.token_ids and g["raw_logprobs"] == w.raw_logprobs
        assert g["sum"] == pytest.approx(w.raw_logprob_sum) and g["is_argmax"] == w.is_argmax
        assert len(g["top_logprobs"]) == len(w.token_ids)
    # A killed run left two lines: the rerun appends the third, the same as before, bit
    # for bit: the rerun scores the third pair in a batch of its own (its padding rows
    # repeat its prompt, which `ll.score` then shares), another program than the first
    # run's batch of three, which the deterministic default of --output makes no matter.
    text = out.read_text()
    out.write_text("".join(text.splitlines(keepends=True)[:2]))
    assert main(args) == 0
    assert out.read_text() == text


@pytest.mark.parametrize(
    "line, match",
    [
        ({"prompt": "x"}, "line 1: give exactly one of 'continuation'"),
        ({"prompt": "x", "continuation": ""}, r"line 1: continuations\[0\] is empty"),
        ({"prompt": "x", "continuation": "y", "temperature": 1}, "unknown key 'temperature'"),
    ],
)
def test_score_bad_line_is_one_error(tmp_path, capsys, line, match):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(line) + "\n")
    assert main(["score", "--input", str(pairs), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("logitloop: error: ") and len(err.splitlines()) == 1
    assert re.search(match, err)


def test_generate_num_beams_is_beam_search(tmp_path, capsys):
    out = tmp_path / "beams.jsonl"
    args = ["generate", "Once upon a time", "The cat", "--num-beams", "3", "-n", "2",
            "--max-tokens", "6", "--length-penalty", "0.5", "--output", str(out), "-q"]  # fmt: skip
    assert main(args) == 0
    model = ll.load_pretrained()
    # A job written to --output runs in the deterministic mode (docs/cli.md).
    want = ll.beam_search(
        model, ["Once upon a time", "The cat"], num_beams=3, max_tokens=6,
        length_penalty=0.5, num_return_sequences=2, deterministic=True,
    )  # fmt: skip
    for line, beams in zip(_lines(out), want, strict=True):
        assert line["token_ids"] == [b.token_ids for b in beams]
        assert line["score"] == [b.score for b in beams]
        assert line["text"] == [b.text for b in beams]
    assert main(["generate", "x", "--num-beams", "2", "--top-p", "0.5"]) == 2
    assert "--top-p does not apply" in capsys.readouterr().err
