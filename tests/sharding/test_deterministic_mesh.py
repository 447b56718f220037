"""`deterministic=True` on a data-parallel mesh: each row's tokens and logprobs should be bit
for bit the single device's (the shipped model in bfloat16, 8 CPU devices in a subprocess).

Not met yet: on the (8, 1) mesh the logprobs differ from one device's by ~1e-6 from the
first token on (the tokens of this case agree). Kept as a strict xfail, so that the fix
turns it into a failure to remove the mark."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._run import REPO, parse, worker_env


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the (8, 1) mesh differs by ~1e-6 (module docstring)")
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
