"""The `--output` file in process (`logitloop.jobs.sinks`): resumed or fresh, locked, and
never destroyed by a job that fails or a disk that fills."""

from __future__ import annotations

import errno
import json
import os

import pytest

from logitloop.jobs.sinks import JsonlOutput, OutputError, check_not_input

OLD = b'{"id": 0, "text": "old"}\n{"id": 1, "text": "old"}\n'


def _records(*ids):
    return [{"id": i, "text": f"new {i}"} for i in ids]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_overwrite_keeps_the_old_file_until_the_first_result(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD)
    out = JsonlOutput.open(str(path), overwrite=True, warn=print)
    assert path.read_bytes() == OLD  # opened (and locked), nothing written yet
    out.write(_records(5), 1)
    assert _lines(path) == _records(5)
    out.write(_records(6), 1)
    out.close()
    assert _lines(path) == _records(5, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_job_that_fails_before_its_first_result_leaves_the_old_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD)
    out = JsonlOutput.open(str(path), overwrite=True, warn=print)
    out.close()  # the job failed (bad line, broken model) before any result
    assert path.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_fresh_file_appears_with_its_first_result(tmp_path):
    path = tmp_path / "new.jsonl"
    out = JsonlOutput.open(str(path), overwrite=False, warn=print)
    assert not path.exists()
    out.write(_records(0), 1)
    assert _lines(path) == _records(0)
    out.close()


def test_a_second_writer_fails_naming_the_file_and_the_holder(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD)
    first = JsonlOutput.open(str(path), overwrite=False, warn=print)
    for overwrite in (False, True):
        with pytest.raises(OutputError) as err:
            JsonlOutput.open(str(path), overwrite=overwrite, warn=print)
        message = str(err.value)
        assert str(path) in message and "locked" in message, message
        if os.path.exists("/proc/locks"):
            assert f"process {os.getpid()}" in message, message
    first.close()
    JsonlOutput.open(str(path), overwrite=False, warn=print).close()  # free again


def test_resume_reports_duplicate_ids(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD + b'{"id": 1, "text": "again"}\n{"id": "1", "text": "a string id"}\n')
    warnings = []
    out = JsonlOutput.open(str(path), overwrite=False, warn=warnings.append)
    out.close()
    assert out.done == {("int", 0), ("int", 1), ("str", "1")}
    assert len(warnings) == 1 and "duplicate" in warnings[0], warnings
    assert "id 1 on lines 2 and 3" in warnings[0], warnings


def test_files_nested_too_deep_are_named_errors_not_crashes(tmp_path):
    """JSON nested past the parser's depth raised RecursionError (a traceback) from a
    resumed output, an input line and a tokenizer config, where bad JSON is a named error."""
    from logitloop.jobs.items import JobError, json_line
    from logitloop.models.tokenizer import _special_tokens_from_config

    deep = b"[" * 100_000
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD + deep + b"\n")
    with pytest.raises(OutputError, match="out.jsonl line 3: not a result line"):
        JsonlOutput.open(str(path), overwrite=False, warn=print)
    with pytest.raises(JobError, match="p.jsonl line 1: JSON nested too deep"):
        json_line(deep.decode(), "p.jsonl line 1", 0)
    config = tmp_path / "tokenizer_config.json"
    for body in (deep, b'{"eos_token": "\xff"}', b"[1]"):
        config.write_bytes(body)
        with pytest.raises(ValueError, match="tokenizer_config.json: "):
            _special_tokens_from_config(config)


def test_full_disk_is_one_error_and_earlier_lines_survive(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    out = JsonlOutput.open(str(path), overwrite=False, warn=print)
    out.write(_records(0, 1), 1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError) as err:
        out.write(_records(2), 1)
    assert str(err.value) == f"cannot write {path}: No space left on device"
    out.close()  # no second error from close
    monkeypatch.undo()
    assert _lines(path)[:2] == _records(0, 1)


# (how the output names the input, whether it is the same file)
SAME_FILE = [
    (lambda p: p, True),
    (lambda p: p.parent / "." / p.name, True),
    (lambda p: _link(p, os.symlink, "sym.txt"), True),
    (lambda p: _link(p, os.link, "hard.txt"), True),
    (lambda p: p.parent / "other.txt", False),
]


def _link(path, make, name):
    link = path.parent / name
    make(path, link)
    return link


@pytest.mark.parametrize(
    "name, same", SAME_FILE, ids=["path", "dot", "symlink", "hardlink", "other"]
)
def test_output_that_is_the_input_is_refused(tmp_path, name, same):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    output = str(name(prompts))
    if same:
        with pytest.raises(OutputError, match="is the input file"):
            check_not_input(output, str(prompts))
    else:
        check_not_input(output, str(prompts))
    check_not_input(output, "-")  # stdin is never the output
    assert prompts.read_text() == "a\nb\n"
