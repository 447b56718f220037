"""A quantized model (int4 projections and vocabulary tables) on a mesh: the scales are
sharded with their weights, (1, 2) gives one device's greedy tokens (logprobs within
float rounding of the split products), deterministic mode on (2, 1) and the
"model-parallel" mode on (1, 2) give one device's run bit for bit, and an Orbax
checkpoint restores straight onto the mesh (`restore_sharded`) with the same layout. One
subprocess with 2 CPU devices (`tests/sharding/quantized_worker.py`)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("qwix", reason="quantized weights need the extra `quant` (qwix)")

from ._run import run_worker  # noqa: E402

# About 45 s of CPU in its subprocess (four generate compiles and a restore): -m slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run() -> dict:
    return run_worker(devices=2, timeout=600, module="tests.sharding.quantized_worker")


def test_mesh_tokens_equal_single_device(run):
    assert run["devices"] == 2
    assert "embedding and LM head int4" in run["describe"]
    single, mesh = run["single"], run["mesh_1x2"]
    assert mesh["token_ids"] == single["token_ids"]
    for a, b in zip(mesh["raw_logprobs"], single["raw_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_deterministic_data_parallel_is_bit_for_bit(run):
    assert run["det_2x1"] == run["det_single"]
    assert run["det_single"]["token_ids"] == run["single"]["token_ids"]


def test_model_parallel_mode_is_bit_for_bit_on_the_model_axis(run):
    from logitloop.models import fixed_order

    if not fixed_order.split_tiles_keep_row_bits():  # as tests/sharding/test_deterministic_mesh
        pytest.xfail("this CPU's XLA product rounds a row by its place in an 8-row tile")
    assert run["mp_1x2"] == run["mp_single"]
    assert run["mp_single"]["token_ids"] == run["single"]["token_ids"]


@pytest.mark.parametrize("layouts", ["sharded_layouts", "restored_layouts"])
def test_scales_are_sharded_with_their_weights(run, layouts):
    got = run[layouts]
    # [key] = [spec, first shard's shape, global shape]
    head_dim = 8
    assert got["['lm_head']['qvalue']"] == [["model", None], [128, 64], [256, 64]]
    assert got["['lm_head']['scale']"] == [["model", None], [128, 4], [256, 4]]
    assert got["['embedding']['scale']"][:2] == [["model", None], [128, 4]]
    layer = "['layers'][0]"
    # q: [E, H, D] over its heads; int4 scales [E / 16, H, D] over the same axis
    assert got[layer + "['wq']['qvalue']"][1] == [64, 4, head_dim]
    assert got[layer + "['wq']['scale']"] == [
        [None, "model", None],
        [4, 4, head_dim],
        [4, 8, head_dim],
    ]
    # o: stored [H * D, E], split over its contraction (whole heads), scales with it
    assert got[layer + "['wo']['qvalue']"][:2] == [["model", None], [32, 64]]
    assert got[layer + "['wo']['scale']"][:2] == [["model", None], [2, 64]]
    # the norms stay replicated
    assert got[layer + "['attn_norm']"][1] == [64]


def test_restore_sharded_is_bit_for_bit_and_generates(run):
    assert run["restored_quantization_equal"] and run["restored_equal"]
    assert run["restored_1x2"]["token_ids"] == run["single"]["token_ids"]
