"""examples/grpo.py (issue 54): two GRPO steps on the shipped model. With
`deterministic=True` the trainer's log-probs are the rollout's (mismatch 0.0), the loss is
finite, the second step compiles nothing (new weights through `nnx.update`), and the log
and the plot are written. About a minute of compiling: `-m slow`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import grpo  # noqa: E402 - an example script, importable once examples/ is on the path


def test_group_advantages_are_standardized_within_each_prompt():
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1], np.float32)
    adv = grpo.group_advantages(rewards, 4)
    np.testing.assert_allclose(adv[:4], [np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3),
                                         -1 / np.sqrt(3)], rtol=1e-5)  # fmt: skip
    np.testing.assert_array_equal(adv[4:], 0)  # one reward for the whole group: no signal


def test_mismatch_is_zero_only_for_equal_logprobs():
    a = np.log(np.array([[0.5, 0.25, 0.1]], np.float32))
    mask = np.array([[False, True, True]])
    assert grpo.mismatch(a, a.copy(), mask) == (0.0, 0.0)
    b = a.copy()
    b[0, 2] += 1e-3
    delta, kl = grpo.mismatch(b, a, mask)
    assert math.isclose(delta, 1e-3, rel_tol=1e-3) and kl > 0


@pytest.mark.slow
def test_two_steps_are_exact_and_compile_once(tmp_path):
    log = grpo.main(["--steps", "2", "--prompts", "2", "--samples", "4", "--max-tokens", "6",
                     "--out", str(tmp_path)])  # fmt: skip
    assert [e["max_abs_delta"] for e in log] == [0.0, 0.0]
    assert [e["kl"] for e in log] == [0.0, 0.0]
    assert all(math.isfinite(e["loss"]) for e in log)
    assert log[1]["compiles"] == 0
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    assert (tmp_path / "grpo.png").stat().st_size > 0
