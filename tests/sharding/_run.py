"""Run `tests.sharding.workers` in subprocesses with their own fake CPU devices.

The pytest process has already imported jax with one CPU device, and the device count is
fixed at import, so every test here does its JAX work in a fresh interpreter whose
environment sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` and
`JAX_PLATFORMS=cpu` before jax is imported. `--xla_backend_optimization_level=0` saves
about a third of the compile time; the single-device reference runs in the same
subprocess under the same flags.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def worker_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    # After the test process's own flags (the root conftest.py's compile options).
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        " --xla_backend_optimization_level=0"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def command(*args: object, module: str = "tests.sharding.workers") -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def parse(stdout: str, stderr: str, what: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT:"):
            return json.loads(line[len("RESULT:") :])
    raise AssertionError(
        f"{what} printed no result.\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}"
    )


def run_worker(
    *args: object, devices: int, timeout: float, module: str = "tests.sharding.workers"
) -> dict:
    """Run one worker (`python -m module *args`); raise with its output if it fails or
    runs past `timeout` seconds."""
    try:
        proc = subprocess.run(
            command(*args, module=module),
            cwd=REPO,
            env=worker_env(devices),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
        raise AssertionError(f"worker {args} ran past {timeout} s\n{e.stderr!r:.5000}") from e
    if proc.returncode != 0:
        raise AssertionError(
            f"worker {args} exited with {proc.returncode}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return parse(proc.stdout, proc.stderr, f"worker {args}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
