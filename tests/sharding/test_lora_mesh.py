"""LoRA adapters per row (issue 71) and steering vectors on a mesh: a batch mixing two
adapters and the base gives one device's greedy tokens on the (2, 4) mesh (logprobs within
float32 rounding of the split products), with the adapter table on every device whole
and the rows' slots over "data"; under `-m slow` also `n=2` sampled rows and `stream`,
steering beside the adapters, `generate_many` on the paged pool with the prefix cache
(an adapter brought into the running job), `score`, and `deterministic=True` (2, 1) and
"model-parallel" (1, 2) bit for bit. One subprocess with 8 CPU devices
(`tests/sharding/lora_worker.py`) runs the cases the selected tests need."""

from __future__ import annotations

import numpy as np
import pytest

from logitloop.models import fixed_order

from ._run import run_worker

ATOL = 1e-4  # as tests/sharding/test_sharded_generate.py: float32 rounding of split products


# The worker's case each slow test reads (`lora_worker.py`).
CASES = {
    "test_n_rows_and_stream_on_a_mesh": "more",
    "test_steering_beside_adapters_on_a_mesh": "more",
    "test_generate_many_on_a_mesh_equals_one_device": "more",
    "test_score_on_a_mesh_equals_one_device": "more",
    "test_deterministic_data_parallel_is_bit_for_bit": "deterministic",
    "test_model_parallel_mode_is_bit_for_bit_on_the_model_axis": "deterministic",
}


@pytest.fixture(scope="module")
def run(request) -> dict:
    """The worker's run of the cases the selected tests of this module need (`CASES`;
    "generate" always: about 40 s of CPU, the slow cases about 3 minutes more)."""
    cases = {"generate"}
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            cases.add(CASES.get(item.originalname, "generate"))
    return run_worker(*sorted(cases), devices=8, timeout=600, module="tests.sharding.lora_worker")


def _same(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    for a, b in zip(got["raw_logprobs"], want["raw_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def test_mixed_adapters_on_a_mesh_equal_one_device(run):
    """Rows 0-2 are one prompt under "a", the base and "b" (the adapters change its
    tokens); every row's greedy tokens on (2, 4) are one device's. The table is
    replicated, whole on every device, and stays so when an adapter is loaded into it;
    the rows' slots go over "data"."""
    single = run["single"]["token_ids"]
    assert len({tuple(t) for t in single[:3]}) == 3
    _same(run["mesh_2x4"], run["single"])
    assert run["layout"] == {
        "table": [[], True],
        "loaded": [[], True],
        "slots": [["data"], False],
    }


@pytest.mark.slow
def test_n_rows_and_stream_on_a_mesh(run):
    """`n=2` sampled rows per prompt under their prompt's adapter, and `stream`."""
    _same(run["n2_mesh"], run["n2_single"])
    assert run["stream_mesh"] == run["n2_single"]["token_ids"]


@pytest.mark.slow
def test_steering_beside_adapters_on_a_mesh(run):
    """`steer=` on rows 0 (its prompt, layer 0) and 2 (its generated tokens, layer 1)."""
    _same(run["steer_mesh"], run["steer_single"])
    assert run["steer_single"]["token_ids"][0] != run["single"]["token_ids"][0]  # it steers


@pytest.mark.slow
def test_generate_many_on_a_mesh_equals_one_device(run):
    """The paged pool with the prefix cache (a pool per data shard), each request's adapter
    and `Request.steer`, "c" brought into the running job by the fourth request; a second
    job bringing "d" instead compiles nothing."""
    _same(run["many_mesh"], run["many_single"])
    assert run["many_mesh_cached"] == run["many_single_cached"] > 0
    assert run["many_mesh_again_compiles"] == 0


@pytest.mark.slow
def test_score_on_a_mesh_equals_one_device(run):
    for a, b in zip(run["score_mesh"], run["score_single"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_deterministic_data_parallel_is_bit_for_bit(run):
    assert run["det_2x1"] == run["det_2x1_single"]
    assert run["det_2x1_single"]["token_ids"] == run["single"]["token_ids"]


@pytest.mark.slow
def test_model_parallel_mode_is_bit_for_bit_on_the_model_axis(run):
    if not fixed_order.split_tiles_keep_row_bits():  # as tests/sharding/test_deterministic_mesh
        pytest.xfail("this CPU's XLA product rounds a row by its place in an 8-row tile")
    assert run["det_1x2"] == run["det_1x2_single"]
