"""Constrained rows on a mesh: the single-device tokens, with the vocabulary split (1, 2)
(each device masks its own columns with the rows' bitmasks) and the rows split (2, 1)."""

from __future__ import annotations

import pytest

from tests.decoding.test_constraints import _valid

from ._run import run_worker


@pytest.fixture(scope="module")
def structured() -> dict:
    return run_worker("structured", devices=2, timeout=600)


@pytest.mark.slow
def test_constrained_rows_on_a_mesh_match_one_device(structured):
    want = structured["single"]
    for row in (1, 2, 3):
        assert want["finish_reason"][row] == "stop"
        assert _valid(row, structured["text"][row])
    for shape in ("1x2", "2x1"):
        assert structured[shape]["token_ids"] == want["token_ids"]
        assert structured[shape]["finish_reason"] == want["finish_reason"]
    assert structured["stream_1x2"] == want["token_ids"]
