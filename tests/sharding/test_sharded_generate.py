"""`generate(..., mesh=...)` gives the single-device tokens on (8,1), (2,4) and (1,8) meshes.

One subprocess with 8 CPU devices runs the single-device reference and the meshes
(to compile once per layout; (8,1) and (1,8) only under `-m slow`), plus `stream`,
`generate_many` and an Orbax restore on the (2,4) mesh.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ._run import run_worker


@pytest.fixture(scope="module")
def meshes(request) -> dict:
    """The worker's run, with the layouts of the selected `test_mesh_tokens_equal_single_device`
    cases ((2, 4) always; (8, 1) and (1, 8) are `-m slow`: the (2, 4) mesh splits both axes)."""
    shapes = {
        item.callspec.params["shape"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and item.originalname == "test_mesh_tokens_equal_single_device"
    }
    return run_worker("meshes", *sorted(shapes), devices=8, timeout=420)


def _assert_same_run(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert got["finish_reason"] == want["finish_reason"]
    assert got["top_ids"] == want["top_ids"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    for a, b in zip(got["raw_logprobs"], want["raw_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize(
    "shape", [pytest.param("8x1", marks=pytest.mark.slow), "2x4",
              pytest.param("1x8", marks=pytest.mark.slow)],
)  # fmt: skip
def test_mesh_tokens_equal_single_device(meshes, shape):
    _assert_same_run(meshes["meshes"][shape], meshes["single"])


def test_reference_is_nontrivial(meshes):
    single = meshes["single"]
    lengths = [len(t) for t in single["token_ids"]]
    assert lengths == [8, 12, 5, 10, 16]  # the ragged max_tokens, no early EOS here
    assert single["logprobs"][0] == [0.0] * 8  # row 0 is greedy
    assert any(lp < -0.5 for row in single["logprobs"][1:] for lp in row)  # others sample


def test_stream_on_mesh_matches(meshes):
    assert meshes["stream_2x4"]["token_ids"] == meshes["single"]["token_ids"]
    assert meshes["stream_2x4"]["finish_reason"] == meshes["single"]["finish_reason"]


def test_processors_on_mesh_match(meshes):
    _assert_same_run(meshes["procs_2x4"], meshes["procs_single"])
    # The processors changed the rows: row 3's ban of its previous token, row 4's forcing.
    assert meshes["procs_single"]["token_ids"] != meshes["single"]["token_ids"]
    assert meshes["procs_single"]["token_ids"][4][2] == 200


def test_generate_many_on_mesh_matches(meshes):
    got = meshes["many_2x4"]
    want = meshes["single"]
    # A request without logprobs has no top logprobs in its own one-prompt result.
    logprobs = [0, 3, 0, 0, 5]  # workers.mixed_params
    top = [want["top_ids"][r] if k else None for r, k in enumerate(logprobs)]
    assert got["top_ids"] == top
    _assert_same_run({**got, "top_ids": want["top_ids"]}, want)


def test_paged_generate_many_on_mesh_matches(meshes):
    """`kv_cache_tokens=48` on the (2, 4) mesh: one pool of 24 tokens per data shard, from
    which only that shard's slots take pages; rows are preempted and resumed in their
    shard, and every request gets the single device's tokens."""
    got, want = meshes["paged_2x4"], meshes["many_2x4"]
    assert got["token_ids"] == want["token_ids"] == meshes["single"]["token_ids"]
    assert got["finish_reason"] == want["finish_reason"]
    assert meshes["paged_stats"]["preemptions"] > 0


def test_the_pool_divides_over_the_data_axis(meshes):
    """Each device holds N / d tokens of keys: 6 of the 12 pages of 4, for its one KV head
    (`tests/sharding/test_paged_mesh.py`: no decode step gathers them)."""
    pool = meshes["paged_pool"]
    assert pool["shape"] == [4, 12, 4, 8]  # [Hkv, 48 / 4 pages, page_size, head_dim]
    assert pool["spec"] == "P('model', 'data')"
    assert pool["shards"] == [[1, 6, 4, 8]]


def test_orbax_restore_onto_mesh(meshes):
    layout = meshes["restored_layout"]
    # wq [E=64, H=8, D=8]: heads over the 4-way model axis; wk: kv heads 4 over 4.
    assert layout["wq"] == ["P(None, 'model', None)", [64, 2, 8]]
    assert layout["wk"] == ["P(None, 'model', None)", [64, 1, 8]]
    assert layout["lm_head"] == ["P('model', None)", [64, 64]]  # vocab 256 over 4
    assert layout["final_norm"] == ["P(None,)", [64]]
    _assert_same_run(meshes["restored_2x4"], meshes["single"])


@pytest.mark.parametrize("how", ["restored_params", "restored_by_names"])
def test_orbax_restore_partitions_weights_and_keeps_values(meshes, how):
    """Every parameter restored onto the (2, 4) mesh equals the saved one bit for bit, and
    each one whose spec names a mesh axis is split: every device holds one piece, the
    pieces are distinct, equally sized and tile the array, and no device holds all of it.
    "restored_params": `sharding.restore_sharded` (the model axis); "restored_by_names":
    shardings mapped from the logical axis names by hand, "embed" over the data axis too."""
    axis_size = {"data": 2, "model": 4}
    split_over_both = 0
    for name, p in meshes[how].items():
        assert p["equal"], name
        assert sorted(device for device, _ in p["shards"]) == list(range(8)), name
        pieces = {tuple(map(tuple, index)) for _, index in p["shards"]}
        ways = math.prod(n for axis, n in axis_size.items() if f"'{axis}'" in p["spec"])
        assert len(pieces) == ways, (name, p["spec"])
        size = math.prod(p["shape"])
        for piece in pieces:
            assert math.prod(stop - start for start, stop in piece) * ways == size, name
        split_over_both += ways == 8
    partitioned = [n for n, p in meshes[how].items() if "'model'" in p["spec"]]
    # 2 layers x (wq, wk, wv, wo, gate, up, down), the embedding and the LM head.
    assert len(partitioned) == 16, partitioned
    if how == "restored_by_names":
        assert split_over_both >= 14
