"""`NoRepeatNGram` against a float64 loop reference and `transformers`' own processor."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.decoding.sampling.processors import Step
from logitloop.processors import NoRepeatNGram

from .cases import apply_jit, assert_bits_equal, make_history, random_rows
from .reference import no_repeat_ngram_row

V, C = 16, 40
SIZES = [2, 3, 0, 1, 2, 3, 4, 0, 5, 2, 1, 6]  # per row; 0 = off


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    rows, num_prompt = random_rows(rng, len(SIZES), V, C)
    logits = rng.normal(size=(len(SIZES), V)).astype(np.float32)
    return rows, num_prompt, logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_per_row(seed):
    rows, num_prompt, logits = _inputs(seed)
    proc = NoRepeatNGram.create(len(SIZES), SIZES)
    out = np.asarray(apply_jit(proc, jnp.asarray(logits), make_history(rows, num_prompt, C)))
    assert np.isneginf(out).any(), "the inputs should ban something"
    for r, n in enumerate(SIZES):
        expected = no_repeat_ngram_row(rows[r], logits[r], n).astype(np.float32)
        assert_bits_equal(out[r], expected, f"row {r} (size {n}, tokens {rows[r]})")


@pytest.mark.parametrize("seed", [3, 4])
def test_matches_transformers(seed):
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rows, num_prompt, logits = _inputs(seed)
    proc = NoRepeatNGram.create(len(SIZES), SIZES)
    out = np.asarray(apply_jit(proc, jnp.asarray(logits), make_history(rows, num_prompt, C)))
    for r, n in enumerate(SIZES):
        if n == 0:
            assert_bits_equal(out[r], logits[r], f"off row {r}")
            continue
        ids = torch.tensor([rows[r]], dtype=torch.long).reshape(1, len(rows[r]))
        peer = lp.NoRepeatNGramLogitsProcessor(n)(ids, torch.tensor(logits[r : r + 1]))
        assert_bits_equal(out[r], peer[0].numpy(), f"row {r} (size {n}, tokens {rows[r]})")


def test_prompt_counts_and_worked_example():
    # Prompt [7, 1, 2, 9], generated [1, 2]: the 3-gram [1, 2, 9] of the prompt bans 9.
    hist = make_history([[7, 1, 2, 9, 1, 2], [7, 1, 2, 9, 1, 2]], [4, 4], 8)
    logits = jnp.zeros((2, 10), jnp.float32)
    out = np.asarray(apply_jit(NoRepeatNGram.create(2, [3, 4]), logits, hist))
    assert np.isneginf(out[0]).tolist() == [t == 9 for t in range(10)]
    assert not np.isneginf(out[1]).any()  # [9, 1, 2] has never been followed by anything


def test_short_history_and_all_banned():
    # Row 0 holds 2 tokens, fewer than n = 3: nothing banned. Row 1, n = 1, has seen every
    # token of the 3-token vocabulary: the whole row is -inf (the all-masked outcome).
    hist = make_history([[0, 1], [2, 0, 1]], [1, 0], 4)
    logits = jnp.asarray([[0.5, -1.0, 2.0], [0.1, 0.2, 0.3]], jnp.float32)
    out = np.asarray(apply_jit(NoRepeatNGram.create(2, [3, 1]), logits, hist))
    assert_bits_equal(out[0], np.asarray(logits[0]), "short row")
    assert np.isneginf(out[1]).all()


def test_new_sizes_compile_nothing(compile_counter):
    rows, num_prompt, logits = _inputs(5)
    hist = make_history(rows, num_prompt, C)
    apply_jit(NoRepeatNGram.create(len(SIZES), SIZES), jnp.asarray(logits), hist)
    with compile_counter as c:
        apply_jit(NoRepeatNGram.create(len(SIZES), SIZES[::-1]), jnp.asarray(logits), hist)
    assert c.count == 0


def test_needs_history():
    proc = NoRepeatNGram.create(1, 2)
    step = Step(positions=jnp.zeros(1, jnp.int32), history=None, done=jnp.zeros(1, bool))
    with pytest.raises(ValueError, match="NoRepeatNGram.*history"):
        proc.apply(proc.init(1, 4), jnp.zeros((1, 4)), step)
