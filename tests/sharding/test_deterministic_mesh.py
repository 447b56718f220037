"""`deterministic=True` on a data-parallel mesh: each row's tokens and logprobs are bit for
bit the single device's (the shipped model in bfloat16, 8 CPU devices in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

from ._run import REPO, parse, worker_env


def test_data_parallel_mesh_equals_one_device_bit_for_bit():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharding.deterministic_worker", "8x1", "2x1"],
        cwd=REPO,
        env=worker_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = parse(proc.stdout, proc.stderr, "deterministic_worker")
    for shape in ("8x1", "2x1"):
        assert out[shape] == out["one"], shape
