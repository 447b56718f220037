"""scripts/train_tiny.py: Orbax checkpoints, exact resume after an interruption, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--steps",
    "4",
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


def train(workdir: Path, out: Path, *extra: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_tiny.py"),
            "--workdir",
            str(workdir),
            "--out",
            str(out),
            *SMALL,
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    train(base / "straight", base / "straight_out")
    # Interrupted after its first step (--max-minutes 0), then resumed to the end.
    first = train(base / "resumed", base / "resumed_out", "--max-minutes", "0")
    second = train(base / "resumed", base / "resumed_out")
    return base, first, second


def test_interrupted_run_resumes_from_its_checkpoint(runs):
    _, first, second = runs
    assert "stopping after 1 steps" in first
    assert "resumed from step 1" in second


def test_resumed_run_equals_an_uninterrupted_one(runs):
    base, _, _ = runs
    a = load_file(str(base / "straight_out" / "model.safetensors"))
    b = load_file(str(base / "resumed_out" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_export_is_a_checkpoint_folder_with_validation_loss(runs):
    base, _, _ = runs
    out = base / "straight_out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()
    report = json.loads((out / "training_report.json").read_text())
    assert np.isfinite(report["validation_loss"]) and report["steps"] == 4
