"""Reuse before compiling (`logitloop.decoding.engine.reuse`; docs/performance.md): a call
runs at the buckets of a program the process already has, when one covers it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine import reuse


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    width: int
    top: int


@pytest.fixture
def fresh():
    """A key no other test uses, so the record starts empty."""
    return object()


def test_fit_picks_the_cheapest_recorded_shape_that_covers_the_need(fresh):
    assert reuse.fit(fresh, Shape(2, 16, 0)) == Shape(2, 16, 0)  # nothing recorded
    reuse.ran(fresh, Shape(8, 64, 20))
    reuse.ran(fresh, Shape(4, 32, 20))
    # Both cover it: the cheaper one; the top-logprob width may grow without bound.
    assert reuse.fit(fresh, Shape(2, 16, 0)) == Shape(4, 32, 20)
    assert reuse.fit(fresh, Shape(8, 16, 0)) == Shape(8, 64, 20)
    # A field past what any recorded shape has is no fit: a program compiles, at the
    # fieldwise largest of the need and what ran (each within its padding limit).
    assert reuse.fit(fresh, Shape(16, 16, 0)) == Shape(16, 64, 20)
    # Padding is bounded: a width may grow at most MAX_PADDING times (64 > 4 * 8).
    assert reuse.fit(fresh, Shape(2, 8, 0)) == Shape(4, 32, 20)
    assert reuse.fit(fresh, Shape(1, 4, 20)) == Shape(8, 4, 20)  # no fit: grown
    # Rows may always grow to 8 (their floor of 2, times MAX_PADDING), beyond that 4 times.
    other = object()
    reuse.ran(other, Shape(32, 16, 0))
    assert reuse.fit(other, Shape(4, 16, 0)) == Shape(4, 16, 0)
    assert reuse.fit(other, Shape(8, 16, 0)) == Shape(32, 16, 0)


def test_fit_keeps_the_type_of_the_need_and_keys_apart(fresh):
    reuse.ran(fresh, {"rows": 8, "width": 16})
    assert reuse.fit(fresh, {"rows": 2, "width": 16}) == {"rows": 8, "width": 16}
    assert reuse.fit(object(), {"rows": 2, "width": 16}) == {"rows": 2, "width": 16}


@pytest.fixture(scope="module")
def shipped():
    return ll.load_pretrained()


def test_generate_after_a_warm_up_runs_its_programs(shipped, compile_counter):
    """After one `generate` of 8 prompts with logprobs and a stop string, calls of fewer
    rows, shorter prompts, no logprobs and other stop strings compile nothing, and each
    row's tokens are those it had in the warm-up's batch."""
    prompts = ["The for statement", "A dictionary", "import os", "class A:", "def f(x):",
               "while True:", "return x", "yield from"]  # fmt: skip
    warm = ll.generate(shipped, prompts, max_tokens=16, logprobs=2, stop=["\n\n"], temperature=0)
    with compile_counter as c:
        few = ll.generate(shipped, prompts[2:5], max_tokens=9, temperature=0)
        one = ll.generate(shipped, prompts[7:], max_tokens=16, logprobs=1, stop=["."],
                          temperature=0)  # fmt: skip
    assert c.count == 0
    for r in range(3):
        n = len(few.token_ids[r])
        assert few.token_ids[r] == warm.token_ids[r + 2][:n]
    assert one.top_logprobs is not None and len(one.top_logprobs[0][0]) == 1
    np.testing.assert_allclose(one.raw_logprobs[0][:3], warm.raw_logprobs[7][:3], atol=1e-5)


def test_score_after_a_warm_up_runs_its_programs(shipped, compile_counter):
    """After one `score` of 8 pairs with continuations of up to 12 tokens, calls of 1 to 8
    pairs with continuations of 1 to 12 tokens compile nothing; the values are those of the
    same pairs scored in the warm-up."""
    rng = np.random.default_rng(70)

    def pairs(rows: int, longest: int):
        prompts = [rng.integers(3, 500, size=rng.integers(2, 14)).tolist() for _ in range(rows)]
        conts = [rng.integers(3, 500, size=rng.integers(1, longest + 1)).tolist()
                 for _ in range(rows)]  # fmt: skip
        conts[0] = conts[0][:1] + [7] * (longest - 1)
        return prompts, conts

    prompts, conts = pairs(8, 12)
    warm = ll.score(shipped, prompts, conts)
    with compile_counter as c:
        for rows, longest in ((1, 1), (3, 5), (8, 12), (5, 2)):
            got = ll.score(shipped, prompts[:rows], [x[:longest] for x in conts[:rows]])
    assert c.count == 0
    for g, w in zip(got, warm, strict=False):
        n = len(g.raw_logprobs)
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs[:n], atol=1e-5)
