"""Packed scoring passes (`decoding.engine.packed`): the layout, a pair's bits wherever it
is packed, the row-by-row reference, and the programs a scoring job compiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine import packed
from tests.decoding.random_llama import small_llama


def test_layout_of_the_docstring_example():
    """Pairs ([a, b, c] + [x, y]) and ([d, e] + [z]) as the module docstring draws them."""
    a, b, c, d, e, x, y, z = range(10, 18)
    got = packed.pack([[a, b, c], [d, e]], [[x, y], [z]])
    n_p = got.shape.prompt_tokens
    assert got.shape == packed.PackShape(
        prompt_tokens=256, cont_tokens=128, rows=8, window=64, reads=128
    )
    assert got.tokens[0, :6].tolist() == [a, b, c, d, e, 0]
    assert got.tokens[0, n_p : n_p + 2].tolist() == [x, 0]  # y, the last, is never fed
    assert got.positions[0, :6].tolist() == [0, 1, 2, 0, 1, -1]
    assert got.positions[0, n_p : n_p + 2].tolist() == [3, -1]
    assert got.rows[0, :5].tolist() == [0, 0, 0, 1, 1] and got.rows[0, n_p] == 0
    # Attention by row and position: row 0 holds a b c x, row 1 d e.
    assert got.keys[:2, :5].tolist() == [[0, 1, 2, n_p, -1], [3, 4, -1, -1, -1]]
    assert (got.keys[2:] == -1).all()  # rows 2..7: padding
    assert got.queries[:, :5].tolist() == got.keys[:, :5].tolist()
    # Reads: c predicts x, x predicts y; e predicts z.
    assert got.read[:3].tolist() == [2, n_p, 4]
    assert got.targets[:3].tolist() == [x, y, z]
    assert got.starts == [0, 2] and got.valid.sum() == 3


def test_shared_prompts_are_fed_and_queried_once_and_keyed_in_each_row():
    got = packed.pack([[5, 6, 7], [5, 6, 7], [8]], [[1, 2], [3, 4], [4]])
    n_p = got.shape.prompt_tokens
    assert got.tokens[0, :4].tolist() == [5, 6, 7, 8]  # the shared prompt once
    assert got.keys[:2, :4].tolist() == [[0, 1, 2, n_p], [0, 1, 2, n_p + 1]]
    assert got.queries[:2, :4].tolist() == [[0, 1, 2, n_p], [-1, -1, -1, n_p + 1]]
    assert got.read[:5].tolist() == [2, n_p, 2, n_p + 1, 3]
    unshared = packed.pack([[5, 6, 7], [5, 6, 7], [8]], [[1, 2], [3], [4]], share=False)
    assert unshared.tokens[0, :7].tolist() == [5, 6, 7, 5, 6, 7, 8]


def test_split_passes_by_token_budget():
    ids = [[1] * 10, [2] * 10, [2] * 10, [3] * 30]
    conts = [[1, 1], [1], [1, 1, 1], [1]]
    # 11 + 10 + 2 (shared prompt) = 23 tokens, then 30 alone over a budget of 25.
    assert packed.split_passes(ids, conts, [0, 1, 2, 3], 25, 8, None, True) == [[0, 1, 2], [3]]
    assert packed.split_passes(ids, conts, [0, 1, 2, 3], 25, 2, None, True) == [[0, 1], [2], [3]]
    assert packed.split_passes(ids, conts, [0, 1, 2, 3], 25, 8, None, False) == [
        [0, 1], [2], [3],
    ]  # fmt: skip


def _pairs(rng, vocab, n, longest_prompt=20, longest_cont=9):
    prompts = [rng.integers(3, vocab, size=int(rng.integers(1, longest_prompt))).tolist()
               for _ in range(n)]  # fmt: skip
    conts = [rng.integers(3, vocab, size=int(rng.integers(1, longest_cont))).tolist()
             for _ in range(n)]  # fmt: skip
    return prompts, conts


def _values(s):
    return (s.raw_logprobs, s.is_argmax, s.top_logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pair_alone_and_packed_among_others_bit_for_bit(dtype):
    """deterministic=True: a pair's values are the same bits alone, packed among others at
    any place in the stream (first, last, behind a shared prompt), and at other budgets
    (one pass per pair, or all in one); with the model's own processing order from
    `generate` (`test_score.py` pins score = generate)."""
    model = small_llama(64, 128, seed=1, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(71)
    prompts, conts = _pairs(rng, 64, 9)
    prompts[4] = prompts[3]  # a shared prompt
    kw = dict(deterministic=True, top_logprobs=2)
    together = ll.score(model, prompts, conts, **kw)
    one_per_pass = ll.score(model, prompts, conts, token_budget=1, **kw)
    reversed_ = ll.score(model, prompts[::-1], conts[::-1], batch_size=3, **kw)[::-1]
    for r in (0, 3, 4, 8):
        (alone,) = ll.score(model, [prompts[r]], [conts[r]], **kw)
        for other in (together[r], one_per_pass[r], reversed_[r]):
            assert _values(other) == _values(alone)


def test_packed_equals_the_row_passes_of_a_mesh():
    """The packed pass against the row-by-row passes (`mesh=` of one device runs them),
    plain numerics: the same values up to float32 rounding, the same argmax."""
    import jax

    model = small_llama(64, 128, seed=2)
    rng = np.random.default_rng(72)
    prompts, conts = _pairs(rng, 64, 7)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    got = ll.score(model, prompts, conts, top_logprobs=3)
    want = ll.score(model, prompts, conts, top_logprobs=3, mesh=mesh)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=0, atol=1e-5)
        assert g.is_argmax == w.is_argmax
        assert list(g.top_logprobs[0]) == list(w.top_logprobs[0])


def test_a_scoring_job_compiles_few_programs(compile_counter):
    """64 pairs of contexts 1..120 and continuations 1..12 tokens: the passes run at few
    shapes (each a program); a second job of other lengths compiles none."""
    model = small_llama(64, 256, seed=3)
    rng = np.random.default_rng(73)
    ll.score(model, [[3]], [[4, 5]], deterministic=True)  # calibration, probes: not the job's
    with compile_counter as c:
        ll.score(model, *_pairs(rng, 64, 64, 120, 13), deterministic=True)
    assert c.count <= 3
    with compile_counter as c:
        ll.score(model, *_pairs(rng, 64, 40, 100, 10), deterministic=True)
    assert c.count == 0


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_token_budget_must_be_a_positive_int(value):
    model = small_llama(64, 128, seed=0)
    with pytest.raises(ValueError, match="token_budget"):
        ll.score(model, [[3, 4]], [[5]], token_budget=value)
