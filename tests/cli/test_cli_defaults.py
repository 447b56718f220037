"""`logitloop generate` in process, on the shipped model: a fresh seed per run written into
every record, top logprobs with their token text, `max_new_tokens` in JSONL, `--stream` with
several prompts and `-n`."""

from __future__ import annotations

import json

import pytest

from logitloop.cli import main

FLAGS = ["--max-tokens", "3", "--no-compile-cache", "-q"]


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["generate", *args, *FLAGS])
    out, err = capsys.readouterr()
    return status, out, err


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_each_run_draws_a_seed_and_records_it(tmp_path, capsys):
    runs = []
    for k in range(2):
        out = tmp_path / f"run{k}.jsonl"
        status, _, err = _generate(capsys, "The for", "x =", "-o", str(out))
        assert status == 0, err
        runs.append(_records(out))
    seeds = [[r["seed"] for r in records] for records in runs]
    assert all(isinstance(s, int) for row in seeds for s in row)
    assert seeds[0][0] == seeds[0][1] and seeds[0][0] != seeds[1][0]  # one per run
    again = tmp_path / "again.jsonl"
    status, _, err = _generate(
        capsys, "The for", "x =", "-o", str(again), "--seed", str(seeds[0][0])
    )
    assert status == 0, err
    assert [r["token_ids"] for r in _records(again)] == [r["token_ids"] for r in runs[0]]


def test_a_drawn_seed_is_named_on_stderr(capsys):
    status = main(["generate", "a", "--max-tokens", "1", "--no-compile-cache"])
    _, err = capsys.readouterr()
    assert status == 0, err
    assert "(drawn for this run; --seed" in err


def test_top_logprobs_carry_the_token_text(tmp_path, capsys):
    from logitloop.models.loading import load_pretrained

    out = tmp_path / "out.jsonl"
    status, _, err = _generate(capsys, "The for", "--logprobs", "3", "-o", str(out))
    assert status == 0, err
    (record,) = _records(out)
    tokenizer = load_pretrained().tokenizer
    for alternatives in record["top_logprobs"]:
        assert len(alternatives) == 3
        for token, _, text in alternatives:
            assert text == tokenizer.decode([token], skip_special_tokens=False)


def test_jsonl_lines_take_max_new_tokens(tmp_path, capsys):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    status, _, err = _generate(capsys, "-i", str(lines), "-o", str(out), "--ignore-eos")
    assert status == 0, err
    assert [r["num_tokens"] for r in _records(out)] == [2, 3]
    lines.write_text('{"prompt": "a", "max_new_tokens": 2, "max_tokens": 4}\n')
    status, _, err = _generate(capsys, "-i", str(lines), "--ignore-eos")
    assert status == 2 and "line 1" in err and "max_new_tokens" in err, err


@pytest.mark.parametrize("n", [1, 2])
def test_stream_prints_what_the_plain_run_prints(capsys, n):
    args = ["The for", "x =", "-n", str(n), "--seed", "5", "--temperature", "1.5"]
    status, plain, err = _generate(capsys, *args)
    assert status == 0, err
    status, streamed, err = _generate(capsys, *args, "--stream")
    assert status == 0, err
    assert streamed == plain
    assert plain.count("==> ") == 2 * n
