"""The paged pool on the (2, 4) mesh, one pool per data shard (8 CPU devices in a
subprocess, about a minute: `-m slow`; the default suite's mesh worker runs a paged job
with preemptions and checks the pool's shards, `test_sharded_generate.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from ._run import run_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paged() -> dict:
    return run_worker("paged_mesh", devices=8, timeout=600)


def test_no_decode_step_gathers_the_pool(paged):
    """No collective of the compiled decode step carries pages ([..., pages, page_size,
    head_dim] with 6 or 12 pages of 4 tokens of 8): each data shard writes and reads its
    own rows' pages. (With the pool replicated over "data" no pages moved either, and
    with it split but read as one array, every layer all-gathered it.)"""
    collectives = paged["paged_pool"]["collectives"]
    assert collectives  # the program's collectives were read (the sampler's, the norms')
    pages = [c for c in collectives if any(s[-3:] in ([6, 4, 8], [12, 4, 8]) for s in c[1])]
    assert pages == []


def test_prefix_cache_on_mesh_equals_no_cache(paged):
    """Requests behind a shared two-page prefix on the (2, 4) mesh: the default pool, with
    a prefix cache per data shard, shares pages and gives the tokens of
    `prefix_cache=False` (the contiguous slots)."""
    cached, plain = paged["prefix_True"], paged["prefix_False"]
    assert cached["token_ids"] == plain["token_ids"]
    assert cached["finish_reason"] == plain["finish_reason"]
    for a, b in zip(cached["raw_logprobs"], plain["raw_logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert paged["prefix_True_stats"]["cached_tokens"] > 0
    assert "cached_tokens" not in paged["prefix_False_stats"]  # no pool at all


def test_n_rows_sharing_a_prompt_on_mesh_equal_one_device(paged):
    """`generate(..., n=2)` on the (2, 4) mesh: each data shard prefills its two prompts
    once into its own pool, their rows fork the pages; the tokens are one device's."""
    got, want = paged["forked_2x4"], paged["forked_single"]
    assert got["token_ids"] == want["token_ids"]
    assert got["finish_reason"] == want["finish_reason"]
    assert len(got["token_ids"]) == 8


def test_deterministic_paged_job_on_mesh_is_one_devices_bit_for_bit(paged):
    """`deterministic=True` on a (2, 1) mesh, one pool of 24 tokens per data shard, rows
    preempted and resumed in their shard: tokens, raw logprobs and logprobs are one
    device's `generate` bit for bit."""
    got, want = paged["det_paged_2x1"], paged["det_single"]
    for key in ("token_ids", "finish_reason", "raw_logprobs", "logprobs"):
        assert got[key] == want[key], key
    assert paged["det_paged_stats"]["preemptions"] > 0


def test_a_users_model_on_the_mesh_and_pool_matches(paged):
    """A user's model through `ll.attention` (the worker's model as a FunctionModel) runs
    the same paged job on the (2, 4) mesh with the same tokens."""
    assert paged["user_paged_2x4"]["token_ids"] == paged["paged_2x4"]["token_ids"]
    assert paged["user_paged_2x4"]["finish_reason"] == paged["paged_2x4"]["finish_reason"]
