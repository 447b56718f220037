"""The `logitloop` command line, end to end: each test runs `python -m logitloop` in a
subprocess (every process start compiles, so the runs are few and small)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.subprocess_env import jax_cache_env

TIMEOUT_S = 300
A, B = 100, 200  # two ordinary token ids for the forced-stop lines
BASE_FLAGS = ["--max-tokens", "10", "--top-p", "0.95", "--batch-size", "4", "--seed", "0"]


_CACHE_VARS = (
    "LOGITLOOP_COMPILE_CACHE",  # tests/conftest.py turns it off for in-process runs
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)
_compile_cache: list[str] = []  # set by the session fixture below


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the CLI processes of this session, so that
    only the first process to meet a program shape pays for compiling it."""
    _compile_cache[:] = [str(tmp_path_factory.mktemp("jax_cache"))]
    yield
    _compile_cache.clear()


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONIOENCODING"] = "utf-8"
    # The CLI's processes are compared with one another (and with fixed texts), not with
    # this process's programs: LLVM's -O0 saves about a third of their compile time, as in
    # the mesh workers (tests/sharding/_run.py). The library's numerics are tested in
    # process, at XLA's default optimization.
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    if _compile_cache:
        env.update(jax_cache_env(_compile_cache[0]))
    else:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "logitloop", *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# 20 lines with mixed per-line settings. Batches of 4: the second batch asks for logprobs and
# stop strings, which needs a second program. Lines 0, 8, 10 and 18 share one setting.
LINES: list[dict] = [
    {"prompt": "The quick brown fox", "temperature": 0, "max_tokens": 16},
    {"id": "greedy-short", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 5},
    {"prompt": "In the beginning", "temperature": 0.9, "seed": 7, "top_p": 0.9, "max_tokens": 12},
    {
        "prompt": "def main():",
        "temperature": 0.7,
        "top_k": 20,
        "seed": 3,
        "repetition_penalty": 1.3,
    },
    {"id": "logprobs", "prompt": "Hello", "temperature": 0, "max_tokens": 6, "logprobs": 3},
    {
        "id": "forced-stop",
        "prompt": "x",
        "temperature": 0,
        "allowed_token_ids": [A, B],
        "logit_bias": {str(B): 50},
        "stop_token_ids": [B],
    },
    {
        "id": "min-tokens",
        "prompt": "x",
        "temperature": 0,
        "allowed_token_ids": [A, B],
        "logit_bias": {str(B): 50},
        "stop_token_ids": [B],
        "min_tokens": 3,
    },
    {"prompt_token_ids": [5, 6, 7, 8], "temperature": 0, "max_tokens": 8, "stop": ["\n", "."]},
    {"prompt": "It was a dark and stormy night", "temperature": 0, "max_tokens": 16},
    {"prompt": "import numpy as np", "temperature": 1.0, "seed": 11, "min_p": 0.05},
    {"prompt": "The", "temperature": 0, "max_tokens": 16},
    {"id": 1000, "prompt": "A B C", "temperature": 0.8, "seed": 5, "presence_penalty": 0.5},
    {"prompt": "class Foo:", "temperature": 0.6, "seed": 1, "frequency_penalty": 0.7},
    {"prompt": "Numbers: 1, 2, 3,", "temperature": 0, "max_tokens": 3},
    {"prompt": "for i in range(10):", "temperature": 1.2, "seed": 99, "top_k": 50},
    {"prompt": "Dear Sir,", "temperature": 0, "banned_token_ids": [A, B]},
    {"prompt": "print(", "temperature": 0.5, "seed": 42, "max_tokens": 1},
    {"prompt": "Once", "seed": 8},
    {"id": "last-but-one", "prompt": "Zebra", "temperature": 0, "max_tokens": 16},
    {"prompt": "The end", "temperature": 0.9, "seed": 2, "top_p": 0.5, "max_tokens": 7},
]
IDS = [line.get("id", i) for i, line in enumerate(LINES)]


def expected_max_tokens(line: dict) -> int:
    return line.get("max_tokens", 10)  # 10 from BASE_FLAGS


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def clean_run(jobs, model_args):
    """One uninterrupted run over the 20-line file."""
    out = jobs.parent / "clean.jsonl"
    proc = run_cli("generate", "--input", str(jobs), "--output", str(out), *BASE_FLAGS, *model_args)
    assert proc.returncode == 0, proc.stderr
    return read_jsonl(out), proc


def test_jsonl_batch_file(clean_run):
    records, proc = clean_run
    assert [r["id"] for r in records] == IDS
    for line, rec in zip(LINES, records, strict=True):
        assert rec["prompt"] == line.get("prompt", line.get("prompt_token_ids"))
        assert set(rec) >= {"text", "token_ids", "num_tokens", "finish_reason", "stop_reason"}
        assert rec["num_tokens"] == len(rec["token_ids"])
        assert 1 <= rec["num_tokens"] <= expected_max_tokens(line)
        assert rec["finish_reason"] in ("stop", "length")
        if rec["finish_reason"] == "length":
            assert rec["num_tokens"] == expected_max_tokens(line)
            assert rec["stop_reason"] is None
        else:
            assert rec["stop_reason"] is not None
        assert isinstance(rec["text"], str)
        if line.get("logprobs"):
            n = rec["num_tokens"]
            assert len(rec["logprobs"]) == len(rec["raw_logprobs"]) == n
            assert len(rec["top_logprobs"]) == n
            assert all(len(alts) == line["logprobs"] for alts in rec["top_logprobs"])
            # greedy: the chosen token is the top raw alternative
            assert [alts[0][0] for alts in rec["top_logprobs"]] == rec["token_ids"]
        else:
            assert "logprobs" not in rec and "top_logprobs" not in rec
        for stop in line.get("stop", []):
            assert stop not in rec["text"]
        if rec["finish_reason"] == "stop" and line.get("stop"):
            assert rec["stop_reason"] in line["stop"] or isinstance(rec["stop_reason"], int)
        for banned in line.get("banned_token_ids", []):
            assert banned not in rec["token_ids"]
    by_id = {r["id"]: r for r in records}
    assert by_id["forced-stop"]["token_ids"] == [B]
    assert by_id["forced-stop"]["finish_reason"] == "stop"
    assert by_id["forced-stop"]["stop_reason"] == B
    assert by_id["min-tokens"]["token_ids"] == [A, A, A, B]
    assert by_id["min-tokens"]["stop_reason"] == B
    assert by_id["greedy-short"]["num_tokens"] <= 5
    # the summary on stderr
    summary = proc.stderr.strip().splitlines()[-1]
    for word in ("20 prompts", "tokens generated", "tokens/s", "compile", "wall"):
        assert word in summary, summary


def test_resume_after_kill_matches_clean_run(jobs, clean_run, model_args, tmp_path):
    records, _ = clean_run
    out = tmp_path / "resumed.jsonl"
    args = ["generate", "--input", str(jobs), "--output", str(out), *BASE_FLAGS, *model_args]
    with open(tmp_path / "stderr.txt", "w") as err:
        # With the session's cache the programs load in well under a second, and the job's
        # last 16 lines still take several decode chunks after the first 4 are written.
        proc = subprocess.Popen(
            [sys.executable, "-m", "logitloop", *args],
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline and proc.poll() is None:
                if out.exists() and out.read_bytes().count(b"\n") >= 4:
                    break
                time.sleep(0.02)
            assert proc.poll() is None, "the run ended before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 4 <= written < len(LINES), written
    # A kill in the middle of a write leaves a partial line; make sure there is one.
    with open(out, "ab") as f:
        f.write(b'{"id": "half a li')

    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "partial last line" in proc.stderr
    assert f"{written} already in" in proc.stderr  # skipped, not rerun
    resumed = read_jsonl(out)
    assert [r["id"] for r in resumed] == IDS  # every id once, in input order
    # Every line is greedy or seeded (the seed defaults to 0), so each run gives the same.
    assert resumed == records

    # A finished job run again does nothing.
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stderr
    assert read_jsonl(out) == records


@pytest.fixture(scope="module")
def plain_run(model_args):
    prompts = [LINES[i]["prompt"] for i in (0, 8, 10, 18)]  # one batch, shaped like the file's
    # The file's job is deterministic (the default with --output): the same numerics here,
    # else a near-tied bfloat16 greedy step may flip between the two modes.
    flags = ["--temperature", "0", "--max-tokens", "16", "--top-p", "0.95", "--deterministic"]
    proc = run_cli("generate", *prompts, *flags, *model_args)
    assert proc.returncode == 0, proc.stderr
    return proc, prompts, flags


def test_prompts_print_one_block_each(plain_run, clean_run):
    proc, _, _ = plain_run
    records, _ = clean_run
    # the same greedy settings as lines 0, 8, 10 and 18 of the batch file
    texts = [records[i]["text"] for i in (0, 8, 10, 18)]
    assert proc.stdout == "\n".join(f"==> {k} <==\n{t}\n" for k, t in enumerate(texts))


def test_stream_prints_the_same_text(plain_run, clean_run, model_args):
    _, prompts, flags = plain_run
    records, _ = clean_run
    proc = run_cli("generate", "--stream", prompts[0], *flags, *model_args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == records[0]["text"] + "\n"


# `--stream --stop` prints what the plain run prints. The first setting is the issue's: the
# spaces inside the first three tokens do not count under --min-tokens 4.
STREAM_STOP_CASES = {
    "min-tokens": (["--stop", " ", "--min-tokens", "4"], ".  Without"),
    "sampled": (
        [
            "--stop",
            "e",
            "--stop",
            ", ",
            "--min-tokens",
            "2",
            "--include-stop-str-in-output",
            "--temperature",
            "1.3",
            "--seed",
            "5",
        ],
        None,
    ),
}


# The min-tokens case compiles its own shapes (about a minute); the library's table test
# (tests/decoding/test_stream_text.py) holds the same example in the default suite.
@pytest.mark.parametrize(
    "case",
    [pytest.param("min-tokens", marks=pytest.mark.slow), "sampled"],
)
def test_stream_with_stop_prints_the_plain_text(case, model_args):
    flags, want = STREAM_STOP_CASES[case]
    args = ["generate", "The for statement", "--max-tokens", "24", *flags, *model_args]
    plain = run_cli(*args)
    assert plain.returncode == 0, plain.stderr
    streamed = run_cli(*args, "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == plain.stdout
    if want is not None and not model_args:
        assert plain.stdout == want + "\n"


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


BAD_INPUTS = {
    "knob": (lambda tmp: ["hello", "--top-p", "1.5"], "top_p = 1.5 is outside the allowed range"),
    "line-knob": (
        lambda tmp: [
            "--input",
            _write(tmp / "k.jsonl", '{"prompt": "a"}\n{"prompt": "b", "temperature": -1}\n'),
        ],
        "k.jsonl line 2: temperature = -1",
    ),
    "model": (lambda tmp: ["hello", "--model", str(tmp / "no-such-model")], "no-such-model"),
    "jsonl": (
        lambda tmp: [
            "--input",
            _write(tmp / "m.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n'),
        ],
        "m.jsonl line 3: not valid JSON",
    ),
    "too-long": (
        lambda tmp: ["--input", _write(tmp / "long.txt", "short\n" + "hello " * 20000 + "\n")],
        "long.txt line 2: the prompt has",
    ),
    "input-file": (lambda tmp: ["--input", str(tmp / "missing.txt")], "input file not found"),
    "non-utf8-argument": (
        lambda tmp: ["fine", "bad \udcff byte"],  # argv bytes b"bad \xff byte"
        "prompt 1: the prompt is not valid text: it holds the byte 0xff",
    ),
    "surrogate-in-jsonl": (
        lambda tmp: ["--input", _write(tmp / "s.jsonl", '{"prompt": "a\\ud800"}\n')],
        "s.jsonl line 1: the prompt is not valid text: it holds the lone surrogate U+D800",
    ),
    "string-max-tokens": (
        lambda tmp: ["--input", _write(tmp / "t.jsonl", '{"prompt": "a", "max_tokens": "8"}\n')],
        "t.jsonl line 1: max_tokens = '8' is not a number",
    ),
    "duplicate-id": (
        lambda tmp: [
            "--input",
            _write(tmp / "d.jsonl", '{"prompt": "a", "id": 1}\n{"prompt": "b"}\n'),
        ],
        "duplicate id 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_status_2(case, model_args, tmp_path):
    make_args, expected = BAD_INPUTS[case]
    args = make_args(tmp_path)
    if case != "model":
        args += model_args
    proc = run_cli("generate", *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("logitloop: error: "), lines[0]
    assert expected in lines[0], lines[0]
    if case == "too-long":
        assert "context" in lines[0]


# --------------------------------------------------------------------------- the output file

OLD_RESULTS = "".join(json.dumps({"id": i, "text": f"old {i}"}) + "\n" for i in range(400))


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("logitloop: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("link, flags", [(None, []), ("symlink", ["--overwrite"])])
def test_output_that_is_the_input_is_refused(link, flags, model_args, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    text = "".join(json.dumps(line) + "\n" for line in LINES[:3])
    prompts.write_text(text, encoding="utf-8")
    output = prompts
    if link:
        output = tmp_path / "results.jsonl"
        output.symlink_to(prompts)
    proc = run_cli(
        "generate", "--input", str(prompts), "--output", str(output), *flags, *model_args
    )
    assert "is the input file" in _one_error_line(proc)
    assert prompts.read_text(encoding="utf-8") == text


def _broken_model(tmp: Path) -> list[str]:
    folder = tmp / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return ["--model", str(folder)]


@pytest.mark.parametrize("failure", ["bad-line-7", "broken-model"])
def test_overwrite_that_fails_keeps_the_old_results(failure, model_args, tmp_path):
    lines = [dict(line) for line in LINES[:10]]
    flags = list(model_args)
    if failure == "bad-line-7":
        lines[6] = {"prompt_token_ids": [1, 10**6]}
    else:
        flags = _broken_model(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    out.write_text(OLD_RESULTS, encoding="utf-8")
    proc = run_cli(
        "generate",
        "--input",
        str(prompts),
        "--output",
        str(out),
        "--overwrite",
        *BASE_FLAGS,
        *flags,
    )
    line = _one_error_line(proc)
    assert ("line 7" in line) if failure == "bad-line-7" else ("model" in line), line
    assert out.read_text(encoding="utf-8") == OLD_RESULTS
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="finds the lock in /proc/locks")
def test_second_run_on_one_output_fails_naming_the_first(jobs, model_args, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("", encoding="utf-8")  # a restart: the output already exists
    args = ["generate", "--input", str(jobs), "--output", str(out), *BASE_FLAGS, *model_args]
    first = subprocess.Popen(
        [sys.executable, "-m", "logitloop", *args],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while f" {first.pid} " not in Path("/proc/locks").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "no lock taken"
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # holds the lock while the second run starts
        line = _one_error_line(run_cli(*args))
        assert str(out) in line and f"process {first.pid}" in line, line
    finally:
        first.kill()
        first.wait()
    assert out.read_text(encoding="utf-8").count("\n") < len(LINES)


def test_resume_says_when_the_output_holds_duplicates(jobs, clean_run, model_args, tmp_path):
    records, _ = clean_run
    out = tmp_path / "out.jsonl"
    lines = [json.dumps(r) + "\n" for r in records]
    out.write_text("".join(lines[:5] + lines[3:4] + lines[5:]), encoding="utf-8")
    proc = run_cli("generate", "--input", str(jobs), "--output", str(out), *BASE_FLAGS, *model_args)
    assert proc.returncode == 0, proc.stderr
    assert "1 duplicate result line" in proc.stderr and "lines 4 and 6" in proc.stderr
    assert "nothing to do" in proc.stderr


@pytest.fixture(scope="module")
def four_greedy_lines(jobs) -> tuple[Path, list[int]]:
    rows = [0, 8, 10, 18]
    path = jobs.parent / "four.jsonl"
    path.write_text("".join(json.dumps({"id": IDS[i], **LINES[i]}) + "\n" for i in rows))
    return path, rows


@pytest.mark.parametrize("output", ["-", "/dev/stdout"])
def test_output_to_stdout(output, four_greedy_lines, clean_run, model_args):
    path, rows = four_greedy_lines
    records, _ = clean_run
    proc = run_cli(
        "generate", "--input", str(path), "--output", output, *BASE_FLAGS, *model_args
    )  # stdout is a pipe here
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [records[i] for i in rows]
    assert not Path("-").exists()


def test_full_disk_is_one_error_line(four_greedy_lines, model_args):
    path, _ = four_greedy_lines
    proc = run_cli(
        "generate", "--input", str(path), "--output", "/dev/full", *BASE_FLAGS, *model_args
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("logitloop:")]
    assert lines == ["logitloop: error: cannot write /dev/full: No space left on device"], lines


@pytest.mark.slow  # two jobs of 120 prompts: about 3 minutes
def test_a_resumed_job_writes_what_an_uninterrupted_one_does(model_args, tmp_path):
    # Issue 47: without the deterministic mode, 4 of these 120 rows came out different when
    # the job was interrupted after 42 rows and resumed in batches of 16.
    starts = ["The for statement", "A dictionary", "The with statement", "def main():"]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        "".join(
            json.dumps({"id": i, "prompt": starts[i % 4] + " " * (i % 3), "seed": i}) + "\n"
            for i in range(120)
        )
    )
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    flags = ["--temperature", "0.8", "--max-tokens", "24", "-q", *model_args]
    proc = run_cli("generate", "-i", str(jobs), "-o", str(whole), "--batch-size", "1", *flags)
    assert proc.returncode == 0, proc.stderr
    lines = whole.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:42]))  # as an interrupted job leaves it
    proc = run_cli("generate", "-i", str(jobs), "-o", str(resumed), "--batch-size", "16", *flags)
    assert proc.returncode == 0, proc.stderr
    assert read_jsonl(resumed) == read_jsonl(whole)


@pytest.mark.slow
def test_kv_cache_tokens_writes_what_the_contiguous_job_does(jobs, clean_run, model_args, tmp_path):
    """`--kv-cache-tokens`: the slots share one paged pool (small enough that rows wait for
    pages); every line gets the tokens of the run without it."""
    out = tmp_path / "paged.jsonl"
    flags = ["--kv-cache-tokens", "96", "--page-size", "16"]
    proc = run_cli("generate", "-i", str(jobs), "-o", str(out), *BASE_FLAGS, *flags, *model_args)
    assert proc.returncode == 0, proc.stderr
    want, _ = clean_run
    assert [r["token_ids"] for r in read_jsonl(out)] == [r["token_ids"] for r in want]


@pytest.mark.slow
def test_no_prefix_cache_writes_what_the_default_does(jobs, clean_run, model_args, tmp_path):
    """`--no-prefix-cache`: contiguous slots, every prompt prefilled whole; every line gets
    the tokens of the default run (a prefix cache on a paged pool)."""
    out = tmp_path / "whole.jsonl"
    flags = ["--no-prefix-cache"]
    proc = run_cli("generate", "-i", str(jobs), "-o", str(out), *BASE_FLAGS, *flags, *model_args)
    assert proc.returncode == 0, proc.stderr
    want, _ = clean_run
    assert [r["token_ids"] for r in read_jsonl(out)] == [r["token_ids"] for r in want]
