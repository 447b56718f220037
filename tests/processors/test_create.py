"""`create` validates on the host, naming the argument, the row and the allowed range."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from logitloop.processors import DRY, NoRepeatNGram, TypicalP

BAD = [
    (
        lambda: NoRepeatNGram.create(3, [2, -1, 0]),
        "size[1] = -1 is outside the allowed range [0, 2147483647]",
    ),
    (lambda: NoRepeatNGram.create(2, 2.5), "size[0] = 2.5 is not an integer"),
    (lambda: NoRepeatNGram.create(2, [1, 2, 3]), "size has 3 entries but batch_size is 2"),
    (
        lambda: DRY.create(2, multiplier=[1.0, -0.5]),
        "multiplier[1] = -0.5 is outside the allowed range [0, ",
    ),
    (lambda: DRY.create(2, base=0.5), "base[0] = 0.5 is outside the allowed range [1, "),
    (lambda: DRY.create(2, allowed_length=[1, 1.5]), "allowed_length[1] = 1.5 is not an integer"),
    (
        lambda: DRY.create(2, penalty_range=-1),
        "penalty_range[0] = -1 is outside the allowed range [0, 2147483647]",
    ),
    (
        lambda: DRY.create(2, sequence_breakers=[[1], [5]], vocab_size=4),
        "sequence_breakers[1] holds token id 5, outside the vocabulary range [0, 3]",
    ),
    (lambda: DRY.create(2, sequence_breakers=[1, "x"]), "sequence_breakers holds 'x'"),
    (lambda: TypicalP.create(2, [0.5, 0.0]), "mass[1] = 0.0 is outside the allowed range (0, 1]"),
    (lambda: TypicalP.create(1, 1.5), "mass = 1.5 is outside the allowed range (0, 1]"),
    (lambda: TypicalP.create(0), "batch_size = 0 is outside the allowed range [1, inf)"),
    (lambda: DRY.create(True), "batch_size must be a positive int"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[m for _, m in BAD])
def test_bad_values_name_argument_row_and_range(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@pytest.mark.parametrize(
    "proc",
    [
        NoRepeatNGram.create(3, [0, 2, 3]),
        DRY.create(3, multiplier=[0.0, 1.0, 2.0], sequence_breakers=[[1], None, [2, 3]]),
        TypicalP.create(3, [1.0, 0.5, 0.9]),
    ],
    ids=lambda p: type(p).__name__,
)
def test_every_leaf_and_state_has_the_row_axis(proc):
    assert all(leaf.shape[0] == 3 for leaf in jax.tree_util.tree_leaves(proc))
    state = proc.init(3, 10)
    assert all(leaf.shape[0] == 3 for leaf in jax.tree_util.tree_leaves(state))
    assert proc.update(state, jnp.zeros(3, jnp.int32), None) is state  # stateless
