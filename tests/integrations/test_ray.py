"""Batch jobs on Ray Data (`logitloop.integrations.ray`, `logitloop generate --ray`): a local
Ray instance (2 CPUs) runs jobs on the shipped model, and each output record equals, field
for field, the CLI's record of a single-process `ll.generate_many` of the same rows. The
200-prompt job on 2 actors, one of them killed mid-job, is `-m slow` (each actor imports JAX
and compiles: tens of seconds on this machine)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray.data", reason="the Ray tests need the optional extra: pip install 'logitloop[ray]'"
)

import logitloop as ll  # noqa: E402
from logitloop.cli import main  # noqa: E402
from logitloop.cli.jobs import (  # noqa: E402
    param_defaults,
    prepare_tokens,
    record,
    row_params,
    validate_params,
)
from logitloop.decoding.loop.runner import model_info  # noqa: E402
from logitloop.integrations import ray as ll_ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (starting one takes seconds)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def _write_rows(path: Path, count: int) -> None:
    """Rows with per-row settings: temperatures, seeds, logprobs, a stop string, token ids."""
    with path.open("w") as f:
        for i in range(count):
            row: dict = {"id": f"r{i}", "prompt": f"Line {i}: the for statement"}
            if i % 3 == 1:
                row["temperature"] = 0.7
                row["seed"] = i
            if i % 4 == 2:
                row["logprobs"] = 2
            if i % 5 == 3:
                row = {"id": i, "prompt_token_ids": [5, 6, 7 + i], "stop": ["\n"]}
            f.write(json.dumps(row) + "\n")


def _reference(paths: str, base: dict) -> dict:
    """The CLI's records from one single-process `generate_many` of every row."""
    model = ll.load_pretrained()
    info = model_info(model)
    base_params = row_params(base)
    items = ll_ray.read_inputs(paths, base, param_defaults())
    validate_params(items, base, base_params)
    prepare_tokens(items, info)
    results = ll.generate_many(
        model, [ll.Request(it.token_ids, it.params) for it in items], deterministic=True
    )
    return {
        json.dumps(it.id): record(it, r, 1, info.tokenizer)
        for it, r in zip(items, results, strict=True)
    }


def _records(path: Path) -> dict:
    lines = path.read_text().splitlines()
    out = {json.dumps(json.loads(line)["id"]): json.loads(line) for line in lines}
    assert len(out) == len(lines), "a row written twice"
    return out


def test_cli_ray_job_equals_single_process_generate_many(local_ray, tmp_path):
    _write_rows(tmp_path / "a.jsonl", 5)
    _write_rows(tmp_path / "b.jsonl", 0)  # an empty file is refused below, as the CLI does
    (tmp_path / "b.jsonl").unlink()
    (tmp_path / "b.jsonl").write_text(
        '{"id": "b0", "prompt": "A dictionary", "temperature": 0}\n{"prompt": "x = 1"}\n'
    )
    inputs = str(tmp_path / "*.jsonl")
    argv = ["generate", "--input", inputs, "--output", f"{tmp_path}/out/", "--ray",
            "--batch-size", "3", "--max-tokens", "4", "--seed", "11", "-q"]  # fmt: skip
    assert main(argv) == 0
    got = _records(tmp_path / "out" / "results.jsonl")
    want = _reference(inputs, {"max_tokens": 4, "seed": 11})
    assert got == want  # field for field, logprobs included, bit for bit (deterministic)
    assert json.dumps(6) in got  # b.jsonl's line 2: its line number after a.jsonl's 5 lines
    # The folder already holds every result: resumed, nothing left to do (no actor started).
    assert main(argv) == 0
    assert _records(tmp_path / "out" / "results.jsonl") == got


def test_bad_rows_are_named(tmp_path):
    """Checked by the CLI's own reader, in the actor (here in-process: no Ray needed)."""
    import numpy as np

    generator = ll_ray.Generator(params={"max_tokens": 2})
    batch = {"id": np.array([0, 1]), "prompt": np.array(["a", "b"], dtype=object),
             "category": np.array(["x", "y"], dtype=object)}  # fmt: skip
    with pytest.raises(ValueError, match=r"row with id 0: unknown key 'category'"):
        generator(batch)
    with pytest.raises(ValueError, match=r"no 'id'"):
        generator({"prompt": np.array(["a"], dtype=object)})
    with pytest.raises(ValueError, match=r"row with id 3: top_p = 1.5"):
        generator({"id": np.array([3]), "prompt": np.array(["a"], dtype=object),
                   "top_p": np.array([1.5])})  # fmt: skip
    # A null cell sets nothing: the column's other rows keep their setting.
    out = generator({"id": np.array([4, 5]), "prompt": np.array(["a", "b"], dtype=object),
                     "temperature": np.array([np.nan, 0.0])})  # fmt: skip
    assert [json.loads(r)["id"] for r in out["record"]] == [4, 5]


def test_missing_ray_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"logitloop\[ray\]"):
        ll_ray.require_ray()
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    argv = ["generate", "-i", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--ray"]
    assert main(argv) == 2
    assert "pip install 'logitloop[ray]'" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc): the local Ray instance's processes."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _map_workers() -> list[int]:
    pids = []
    for pid in _children(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"MapWorker" in cmd:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_200_prompts_two_actors_one_killed(local_ray, tmp_path):
    """200 prompts on 2 actors; after the first batch is written one actor is killed: Ray
    restarts it and retries its batch, and every row is written exactly once, each equal to
    the single-process record."""
    _write_rows(tmp_path / "in.jsonl", 200)
    killed = []

    def write(records, n):
        sink.write(records, n)
        if not killed:
            workers = _map_workers()
            assert workers, "no Ray Data actor process found"
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    from logitloop.cli.sinks import JsonlOutput

    sink = JsonlOutput.open(str(tmp_path / "out.jsonl"), False, print)
    base = {"max_tokens": 4, "seed": 3}
    items = ll_ray.read_inputs(str(tmp_path / "in.jsonl"), base, param_defaults())
    try:
        ll_ray.run_items(items, base, write, workers=2, batch_size=16, progress=False)
    finally:
        sink.close()
    assert killed
    got = _records(tmp_path / "out.jsonl")
    assert got == _reference(str(tmp_path / "in.jsonl"), base)
