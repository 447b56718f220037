"""scripts/train_tiny.py: Orbax checkpoints, exact resume after an interruption (the
cooperative --max-minutes stop, and a SIGKILL), export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.subprocess_env import jax_cache_env

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SMALL = [
    "--steps",
    str(STEPS),
    "--batch",
    "2",
    "--seq",
    "16",
    "--vocab",
    "300",
    "--hidden",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--ffn",
    "64",
    "--context",
    "64",
    "--ckpt-every",
    "1",
    "--eval-every",
    "2",
]


def command(workdir: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts" / "train_tiny.py"),
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        *SMALL,
        *extra,
    ]


def environment(base: Path) -> dict[str, str]:
    """The runs' environment: one JAX compilation cache for the module's five runs, so that
    only the first compiles (about 4.5 s of each ~9.5-s run); the others load the same
    executables, so their arithmetic is the first run's."""
    return dict(os.environ, JAX_PLATFORMS="cpu", **jax_cache_env(str(base / "jax_cache")))


def train(workdir: Path, out: Path, *extra: str) -> str:
    proc = subprocess.run(
        command(workdir, out, *extra),
        env=environment(workdir.parent),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def train_and_kill(workdir: Path, out: Path) -> int:
    """Start a run, SIGKILL it as soon as a checkpoint is on disk (the next step's may be
    half written), and return that step."""
    checkpoints = workdir / "checkpoints"
    log = workdir.parent / f"{workdir.name}.stderr"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            command(workdir, out),
            env=environment(workdir.parent),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 600
            steps = []
            while time.monotonic() < deadline and proc.poll() is None:
                steps = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()]
                if steps:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.01)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr_tail = log.read_text(errors="replace")[-2000:]
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stderr_tail)
    return min(steps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    train(base / "straight", base / "straight_out")
    # Interrupted after its first step (--max-minutes 0), then resumed to the end.
    first = train(base / "resumed", base / "resumed_out", "--max-minutes", "0")
    second = train(base / "resumed", base / "resumed_out")
    # Killed with SIGKILL once a checkpoint exists, then resumed to the end.
    killed_at = train_and_kill(base / "killed", base / "killed_out")
    after_kill = train(base / "killed", base / "killed_out")
    return base, first, second, killed_at, after_kill


def test_interrupted_run_resumes_from_its_checkpoint(runs):
    _, first, second, _, _ = runs
    assert "stopping after 1 steps" in first
    assert "resumed from step 1" in second


@pytest.mark.parametrize("run", ["resumed", "killed"])
def test_resumed_run_equals_an_uninterrupted_one(runs, run):
    """The exported weights, and the float32 losses (the validation loss of the final
    float32 parameters and every logged train/validation loss after the resume), equal the
    uninterrupted run's bit for bit."""
    base = runs[0]
    a = load_file(str(base / "straight_out" / "model.safetensors"))
    b = load_file(str(base / f"{run}_out" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    want = json.loads((base / "straight_out" / "training_report.json").read_text())
    got = json.loads((base / f"{run}_out" / "training_report.json").read_text())
    assert got["validation_loss"] == want["validation_loss"]
    assert got["log"] and got["log"] == want["log"][-len(got["log"]) :]


def test_killed_run_resumes_from_its_last_checkpoint(runs):
    _, _, _, killed_at, after_kill = runs
    assert 1 <= killed_at < STEPS
    resumed = int(after_kill.split("resumed from step ")[1].split()[0])
    assert killed_at <= resumed < STEPS


def test_export_is_a_checkpoint_folder_with_validation_loss(runs):
    base = runs[0]
    out = base / "straight_out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()
    report = json.loads((out / "training_report.json").read_text())
    assert np.isfinite(report["validation_loss"]) and report["steps"] == STEPS
