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
from logitloop.decoding.loop.runner import model_info  # noqa: E402
from logitloop.integrations import ray as ll_ray  # noqa: E402
from logitloop.jobs.items import (  # noqa: E402
    job_bounds,
    param_defaults,
    prepare_tokens,
    read_inputs,
    record,
    row_params,
    validate_params,
)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One local Ray instance for the module (starting one takes seconds), its actors and
    this process sharing a compile cache: the reference compiles a job's programs, and an
    actor running the same shapes reads them instead of compiling again."""
    import ray

    from logitloop.compile_cache import enable_compile_cache

    folder = tmp_path_factory.mktemp("ray_compile_cache")
    folder.chmod(0o700)
    cache = enable_compile_cache(folder)
    ray.init(
        num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
        runtime_env={"env_vars": {"LOGITLOOP_COMPILE_CACHE": str(folder)}},
    )  # fmt: skip
    yield ray
    ray.shutdown()
    if cache is not None:
        cache.disable()


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


def _reference(paths: str, base: dict, slots: int) -> dict:
    """The CLI's records from one single-process `generate_many` of every row (run with the
    shapes of a job of one batch of `slots` rows, so that its programs are the actor's)."""
    model = ll.load_pretrained()
    info = model_info(model)
    items = read_inputs(paths, base, param_defaults())
    validate_params(items, base, row_params(base))
    prepare_tokens(items, info)
    results = ll.generate_many(
        model, [ll.Request(it.token_ids, it.params) for it in items], deterministic=True,
        slots=slots, **job_bounds(items, info, param_defaults()),
    )  # fmt: skip
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
    """Two input files (a glob), rows with their own settings and logprobs, one actor."""
    (tmp_path / "a.jsonl").write_text(
        '{"id": "a0", "prompt": "Line 1:", "temperature": 0.7, "seed": 5, "logprobs": 2}\n'
        '{"prompt_token_ids": [5, 6, 7], "stop": ["\\n"]}\n'
    )
    (tmp_path / "b.jsonl").write_text('{"prompt": "A dictionary"}\n')
    inputs = str(tmp_path / "*.jsonl")
    want = _reference(inputs, {"max_tokens": 3, "seed": 11}, slots=3)
    argv = ["generate", "--input", inputs, "--output", f"{tmp_path}/out/", "--ray",
            "--batch-size", "3", "--max-tokens", "3", "--seed", "11", "-q"]  # fmt: skip
    assert main(argv) == 0
    got = _records(tmp_path / "out" / "results.jsonl")
    assert got == want  # field for field, logprobs included, bit for bit (deterministic)
    assert set(got) == {'"a0"', "1", "2"}  # b.jsonl's line: its number after a.jsonl's 2
    # The folder already holds every result: resumed, nothing left to do (no actor started).
    assert main(argv) == 0
    assert _records(tmp_path / "out" / "results.jsonl") == got


def test_bad_rows_are_named(tmp_path):
    """Checked by the job reader the CLI uses, in the actor (here in-process: no Ray needed)."""
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
    rows = ll_ray.batch_objects({"id": np.array([4, 5]), "temperature": np.array([np.nan, 0.5]),
                                 "prompt_token_ids": np.array([[1, 2], [3, 4]])})  # fmt: skip
    assert [obj for obj, _ in rows] == [
        {"id": 4, "prompt_token_ids": [1, 2]},
        {"id": 5, "prompt_token_ids": [3, 4], "temperature": 0.5},
    ]


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

    from logitloop.jobs.sinks import JsonlOutput

    sink = JsonlOutput.open(str(tmp_path / "out.jsonl"), False, print)
    base = {"max_tokens": 4, "seed": 3}
    items = read_inputs(str(tmp_path / "in.jsonl"), base, param_defaults())
    try:
        ll_ray.run_items(items, base, write, workers=2, batch_size=16, progress=False)
    finally:
        sink.close()
    assert killed
    got = _records(tmp_path / "out.jsonl")
    assert got == _reference(str(tmp_path / "in.jsonl"), base, slots=16)


@pytest.mark.slow
def test_generate_jsonl_resumes_a_folder(local_ray, tmp_path):
    """The one-call helper: a folder output, then resumed after more rows are added."""
    _write_rows(tmp_path / "in.jsonl", 6)
    base = {"max_tokens": 3, "seed": 2}
    done = ll_ray.generate_jsonl(str(tmp_path / "in.jsonl"), f"{tmp_path}/out/", params=base,
                                 batch_size=3, slots=3)  # fmt: skip
    assert done == 6
    _write_rows(tmp_path / "in.jsonl", 9)  # three more rows; the first six are in out/
    done = ll_ray.generate_jsonl(str(tmp_path / "in.jsonl"), tmp_path / "out", params=base,
                                 batch_size=3, slots=3)  # fmt: skip
    assert done == 3
    got = _records(tmp_path / "out" / "results.jsonl")
    assert got == _reference(str(tmp_path / "in.jsonl"), base, slots=3)


def test_guidance_and_steering_columns_equal_generate():
    """A batch's `guidance_scale`, `negative_prompt` and `steer` columns (null cells set
    nothing; `steer` as JSON text, one of the forms a column carries) go to each row's
    request: the greedy tokens are `ll.generate`'s (in-process: no Ray needed)."""
    import numpy as np

    vector = np.random.default_rng(0).standard_normal(256).round(4)
    steer = {"layer": 1, "vector": vector.tolist(), "scale": 4.0, "tokens": "generated"}
    prompt = "The for statement"
    batch = {
        "id": np.array([0, 1, 2]),
        "prompt": np.array([prompt] * 3, dtype=object),
        "guidance_scale": np.array([np.nan, 3.0, np.nan]),
        "negative_prompt": np.array([None, "A dog", None], dtype=object),
        "steer": np.array([None, None, json.dumps(steer)], dtype=object),
    }
    generator = ll_ray.Generator(params={"max_tokens": 4, "temperature": 0}, slots=4)
    got = [json.loads(text)["token_ids"] for text in generator(batch)["record"]]
    want = ll.generate(
        generator.model, [prompt] * 3, max_tokens=4, temperature=0, deterministic=True,
        guidance_scale=[None, 3.0, None], negative_prompt=[None, "A dog", None],
        steer=[None, None, ll.Steer(vector.astype(np.float32), 1, 4.0, "generated")],
    ).token_ids  # fmt: skip
    assert got == want and len({tuple(t) for t in want}) == 3


def test_a_steer_cell_is_nested_or_json_text():
    """The two forms of a `steer` column (a struct column's cell, its missing fields null,
    or JSON text) read as the same setting; bad JSON text is named by its row."""
    import numpy as np

    from logitloop.jobs.request_keys import steers

    nested = {"layer": np.int64(1), "vector": np.array([0.5, -1.0]), "scale": None}
    text = json.dumps({"layer": 1, "vector": [0.5, -1.0]})
    rows = ll_ray.batch_objects({"id": np.array([0, 1]), "prompt": np.array(["a", "b"]),
                                 "steer": np.array([[nested], text], dtype=object)})  # fmt: skip
    got = [[(s.layer, s.vector.tolist(), s.scale, s.tokens) for s in steers(obj["steer"])]
           for obj, _ in rows]  # fmt: skip
    assert got == [[(1, [0.5, -1.0], 1.0, "both")]] * 2
    with pytest.raises(ValueError, match=r"row with id 2: steer is not valid JSON text"):
        ll_ray.batch_objects({"id": np.array([2]), "steer": np.array(["{"], dtype=object)})
