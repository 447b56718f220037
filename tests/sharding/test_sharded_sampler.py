"""The vocabulary-sharded sampler equals the unsharded one, token for token.

In a subprocess with 8 CPU devices: `filter_and_sample_sharded` against
`xla.filter_and_sample` on (1,8) and (2,4) meshes over greedy, temperature, small and
far top-k (count bisection), narrow and wide top-p (mass bisection), min-p and mixed rows,
with ties and masked tails; and `sharding.sample_sharded` (the whole step: masks, bias,
bans, allow-lists, min_tokens, penalties, bad rows, top logprobs) against `sample`.
"""

from __future__ import annotations

import pytest

from ._run import run_worker


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("sampler", devices=8, timeout=300)


def test_operator_matches_unsharded(result):
    assert result["mismatches"] == []
    assert result["compared"] > 500


def test_sampling_step_matches_unsharded(result):
    assert result["step_mismatches"] == []


def test_top_k_sharded_is_lax_top_k(result):
    assert result["top_k_ok"]
