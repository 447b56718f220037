"""The vocabulary-sharded sampler equals the unsharded one, token for token.

In a subprocess with 8 CPU devices: `filter_and_sample_sharded` against
`xla.filter_and_sample` on (1,8) and (2,4) meshes over greedy, temperature, small and
far top-k (count bisection), narrow and wide top-p (mass bisection), min-p and mixed rows,
with ties and masked tails, and its kept sets against the float64 reference;
`sharding.sample_sharded` (the whole step: masks, bias, bans, allow-lists, min_tokens,
penalties, bad rows, top logprobs) against `sample`; and the compiled HLO of that step, for
collectives that would carry the vocabulary.
"""

from __future__ import annotations

import math

import pytest

from logitloop.ops.sampling.xla import NUM_CANDIDATES

from ._run import run_worker


@pytest.fixture(scope="module")
def result() -> dict:
    return run_worker("sampler", devices=8, timeout=300)


def test_operator_matches_unsharded(result):
    """Tokens, thresholds and log-probabilities equal the unsharded operator's, and every
    sampled row's kept set (x >= the combined threshold) equals the float64 reference's,
    top-p rows included: the logits are drawn away from boundaries within float32 rounding,
    the only place the docstring of `logitloop.ops.sampling.sharded` allows a difference."""
    assert result["mismatches"] == []
    assert result["compared"] > 500
    assert result["kept_rows_checked"] > 800


def test_sampling_step_matches_unsharded(result):
    assert result["step_mismatches"] == []


def test_top_k_sharded_is_lax_top_k(result):
    assert result["top_k_ok"]


def test_sampling_step_never_gathers_the_vocabulary(result):
    """In the compiled `sample_sharded` (V = 32768 over 8 or 4 shards), no collective result
    carries more than the candidate exchange: each shard's top C = NUM_CANDIDATES (value,
    id) pairs per row, n * C values per row, far below V. Every other collective is a
    per-row scalar (maxima, sums, counts, the race's best score)."""
    vocab = result["hlo_vocab"]
    for mesh, rows, shards in (("1x8", 16, 8), ("2x4", 8, 4)):
        collectives = result["collectives"][mesh]
        exchange = shards * NUM_CANDIDATES  # per row
        assert exchange < vocab
        assert ["all-gather", [[rows, exchange]]] in collectives  # the check sees gathers
        for op, shapes in collectives:
            for shape in shapes:
                assert vocab not in shape, (mesh, op, shape)
                assert math.prod(shape) <= rows * exchange, (mesh, op, shape)
