"""`deterministic=True` on a data-parallel mesh: each row's tokens, raw logprobs, logprobs
and finish reasons are bit for bit the single device's, for `generate` on (8, 1) and (2, 1)
meshes and for `generate_many` on (8, 1); the shipped model in bfloat16 and a random
float32 Llama with grouped-query attention whose 6 rows the (8, 1) mesh pads to 8 (8 CPU
devices in a subprocess).

Each device tiles its own rows (`fixed_order.rowwise`); before it did, the partitioner
split a tile's rows over the devices and the (8, 1) mesh's logprobs differed by ~1e-6."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._run import REPO, parse, worker_env

# One subprocess, about a minute on 2 cores: in `-m slow`, beside the full batch matrix
# (`tests/decoding/test_deterministic.py`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharding.deterministic_worker", "8x1", "2x1"],
        cwd=REPO,
        env=worker_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return parse(proc.stdout, proc.stderr, "deterministic_worker")


@pytest.mark.parametrize("model", ["shipped", "gqa_llama"])
@pytest.mark.parametrize("run", ["8x1", "2x1", "many_8x1"])
def test_data_parallel_mesh_equals_one_device_bit_for_bit(runs, model, run):
    assert runs[f"{model}/{run}"] == runs[f"{model}/one"]


def test_the_rows_are_not_trivial(runs):
    one = runs["shipped/one"]
    assert len({tuple(t) for t in one["token_ids"]}) == len(one["token_ids"])
    assert any(lp < -0.5 for row in one["logprobs"] for lp in row)  # sampled rows
