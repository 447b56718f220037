"""Properties of the sampler that hold for any logits and settings (hypothesis).

Shapes are fixed (B rows, V tokens) so that every example reuses one compiled sampler.
Logits live on a 1/16 grid: adding a grid-aligned constant, or scaling by a power of two, is
then exact in float32, so "changes nothing" can be asserted exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import logitloop as ll

from .sampler_cases import Row, batch_inputs

B, V = 4, 32
SETTINGS = settings(max_examples=25, deadline=None, database=None)


@st.composite
def grid_logits(draw, rows=B, with_neg_inf=True):
    """[rows, V] float32 on a 1/16 grid in [-20, 20], ties likely, some -inf."""
    ints = draw(hnp.arrays(np.int32, (rows, V), elements=st.integers(-320, 320)))
    x = ints.astype(np.float32) / 16
    if with_neg_inf:
        mask = draw(hnp.arrays(np.bool_, (rows, V), elements=st.booleans()))
        mask[:, 0] = False  # one finite token per row at least
        x[mask & (ints % 5 == 0)] = -np.inf
    return x


@st.composite
def rows(draw, n=B, temperatures=(0.0, 0.5, 0.7, 1.0, 1.5, 2.0), repetition=True):
    """n random rows: truncation, penalties, masks, history, seed, position."""
    generated = draw(st.integers(0, 3))
    out = []
    for _ in range(n):
        ids = st.integers(0, V - 1)
        out.append(
            Row(
                temperature=draw(st.sampled_from(temperatures)),
                top_k=draw(st.sampled_from([0, 1, 2, 5, V - 1, V, V + 3, -1])),
                top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])),
                min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
                repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])) if repetition else 1.0,
                presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
                frequency_penalty=draw(st.sampled_from([0.0, 0.25, -0.5])),
                logit_bias=draw(
                    st.dictionaries(ids, st.sampled_from([-3.0, 1.5, 4.0]), max_size=3)
                ),
                banned=tuple(draw(st.lists(ids, max_size=3, unique=True))),
                min_tokens=draw(st.integers(0, 2)),
                stop_token_ids=tuple(draw(st.lists(ids, max_size=2, unique=True))),
                position=draw(st.integers(0, 3)),
                prompt_tokens=tuple(draw(st.lists(ids, max_size=5))),
                generated_tokens=tuple(draw(st.lists(ids, min_size=generated, max_size=generated))),
                seed=draw(st.integers(0, 2**32 - 1)),
                # The top-logprobs width is static (the widest row's): three widths, so the
                # examples share a few compiled programs rather than compiling one each.
                logprobs=draw(st.sampled_from([0, 3, 20])),
            )
        )
    return out


def run(logits, batch):
    params, positions, hist = batch_inputs(batch, V)
    x = jnp.asarray(logits)
    out = ll.sample(x, params, positions, history=hist)
    probs = ll.sampling_distribution(x, params, positions, history=hist)
    return jax.tree.map(np.asarray, out), np.asarray(probs)


def assert_outputs_equal(a, b):
    for name, x, y in zip(
        ("tokens", "logprobs", "raw_logprobs", "ids", "values", "status"),
        (a.tokens, a.logprobs, a.raw_logprobs, a.top_logprobs.ids, a.top_logprobs.values, a.status),
        (b.tokens, b.logprobs, b.raw_logprobs, b.top_logprobs.ids, b.top_logprobs.values, b.status),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y, err_msg=name)


@SETTINGS
@given(
    x=hnp.arrays(np.float32, (B, V), elements=st.floats(-30, 30, width=32)),
    top_k=st.lists(st.sampled_from([0, -1, -7, V, V + 9]), min_size=B, max_size=B),
    history=st.lists(st.integers(0, V - 1), max_size=4),
)
def test_neutral_settings_give_the_plain_softmax(x, top_k, history):
    batch = [
        Row(
            top_k=k,
            temperature=1.0,
            top_p=1.0,
            min_p=0.0,
            prompt_tokens=tuple(history),
            generated_tokens=tuple(history[:2]),
        )
        for k in top_k
    ]
    _, probs = run(x, batch)
    x64 = x.astype(np.float64)
    softmax = np.exp(x64 - x64.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(probs, softmax, rtol=0, atol=1e-5)


@SETTINGS
@given(
    x=grid_logits(),
    batch=rows(temperatures=(0.0, 0.5, 1.0, 2.0), repetition=False),
    shift=st.lists(st.integers(-800, 800), min_size=B, max_size=B),
)
def test_adding_a_constant_to_a_row_changes_nothing(x, batch, shift):
    # Repetition penalty is excluded: dividing positive and multiplying negative logits is
    # not shift-invariant by definition.
    shifted = x + np.asarray(shift, np.float32)[:, None] / 16
    a, pa = run(x, batch)
    b, pb = run(shifted, batch)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.status, b.status)
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-6)


@SETTINGS
@given(x=grid_logits(), batch=rows(), perm=st.permutations(range(B)))
def test_permuting_the_rows_permutes_the_outputs(x, batch, perm):
    a, pa = run(x, batch)
    b, pb = run(x[perm], [batch[i] for i in perm])
    assert_outputs_equal(jax.tree.map(lambda v: v[np.asarray(perm)], a), b)
    np.testing.assert_array_equal(pa[perm], pb)


@SETTINGS
@given(
    x=grid_logits(),
    batch=rows(),
    others=grid_logits(),
    other_rows=rows(),
    row=st.integers(0, B - 1),
    slot=st.integers(0, B - 1),
)
def test_a_rows_token_depends_only_on_its_own_inputs(x, batch, others, other_rows, row, slot):
    a, _ = run(x, batch)
    again, _ = run(x, batch)
    assert_outputs_equal(a, again)  # same seed and position: same token
    # The same row at another index among other rows, and alone in a batch of one.
    n_gen = len(batch[row].generated_tokens)
    mixed_rows = [dataclasses.replace(r, generated_tokens=(0,) * n_gen) for r in other_rows]
    mixed_rows[slot] = batch[row]
    mixed_x = others.copy()
    mixed_x[slot] = x[row]
    mixed, _ = run(mixed_x, mixed_rows)
    alone, _ = run(x[row : row + 1], [batch[row]])
    n = batch[row].logprobs
    expected = own_row(a, row, n)
    assert_outputs_equal(own_row(mixed, slot, n), expected)
    assert_outputs_equal(own_row(alone, 0, n), expected)


def own_row(out, r, n):
    """Row r of a batch's outputs, its top logprobs cut to its own n: a batch's are as wide
    as its largest n (`ll.TopLogprobs`), the columns past a row's n padding."""
    one = jax.tree.map(lambda v: v[r : r + 1], out)
    top = one.top_logprobs
    assert np.all(top.ids[:, n:] == -1) and np.all(top.values[:, n:] == -np.inf)
    return one.replace(top_logprobs=top.replace(ids=top.ids[:, :n], values=top.values[:, :n]))


@SETTINGS
@given(
    x=grid_logits(),
    batch=rows(temperatures=(0.0,)),
    hot=st.lists(
        st.tuples(
            st.sampled_from([0.3, 1.0, 1.7]),
            st.sampled_from([1.0, 0.5, 0.1]),
            st.sampled_from([0.0, 0.5, 1.0]),
        ),
        min_size=B,
        max_size=B,
    ),
)
def test_temperature_zero_is_top_k_one_bit_for_bit(x, batch, hot):
    greedy_rows = [dataclasses.replace(r, temperature=0.0) for r in batch]
    top1_rows = [
        dataclasses.replace(r, temperature=t, top_k=1, top_p=p, min_p=m)
        for r, (t, p, m) in zip(batch, hot, strict=True)
    ]
    a, pa = run(x, greedy_rows)
    b, pb = run(x, top1_rows)
    assert_outputs_equal(a, b)
    np.testing.assert_array_equal(pa, pb)


@st.composite
def wide_logits(draw):
    """[B, V] float32 spanning 0 to -40 below the top: the float32 running mass of the
    largest tokens reaches 1 before the tail, where a cumulative top-p would cut. Scaled by
    1 / T <= 2, every weight exp(x - max) stays a normal float32 (XLA flushes subnormals)."""
    ints = draw(hnp.arrays(np.int32, (B, V), elements=st.integers(-640, 0)))
    x = ints.astype(np.float32) / 16
    x[:, 0] = 0.0
    mask = draw(hnp.arrays(np.bool_, (B, V), elements=st.booleans()))
    mask[:, 0] = False
    x[mask & (ints % 7 == 0)] = -np.inf
    return x


@SETTINGS
@given(
    x=wide_logits(),
    top_k=st.lists(st.sampled_from([0, 2, 5, 17, V - 1, V, -1]), min_size=B, max_size=B),
    temperature=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=B, max_size=B),
    seeds=st.lists(st.integers(0, 2**32 - 1), min_size=B, max_size=B),
)
def test_top_p_one_and_min_p_zero_are_exact_identities(x, top_k, temperature, seeds):
    # With top_p = 1 and min_p = 0, the distribution and the draw are bit for bit those of
    # top-k alone: the library's final softmax and race run on thresholds made here, with the
    # top-k threshold read off a NumPy sort and top-p and min-p off (-inf).
    from logitloop.decoding.sampling.sampler import kept_distribution
    from logitloop.ops.sampling.noise import row_keys
    from logitloop.ops.sampling.xla import Thresholds, candidates, draw

    batch = [
        Row(top_k=k, temperature=t, top_p=1.0, min_p=0.0, seed=s)
        for k, t, s in zip(top_k, temperature, seeds, strict=True)
    ]
    out, probs = run(x, batch)
    params, positions, _ = batch_inputs(batch, V)
    # Powers of two: the product with 1 / T is exact, so these are the sampler's scaled bits.
    scaled = x * (np.float32(1) / np.asarray(temperature, np.float32))[:, None]
    desc = -np.sort(-scaled, axis=1)
    t_k = np.asarray(
        [desc[r, k - 1] if 0 < k < V else -np.inf for r, k in enumerate(top_k)], np.float32
    )
    off = jnp.full((B,), -jnp.inf, jnp.float32)
    thr = Thresholds(row_max=jnp.asarray(desc[:, 0]), top_k=jnp.asarray(t_k), top_p=off, min_p=off)
    greedy = jnp.zeros((B,), bool)
    want_probs = kept_distribution(jnp.asarray(scaled), thr, greedy)
    np.testing.assert_array_equal(probs, np.asarray(want_probs))
    cand_x, cand_i = candidates(jnp.asarray(scaled), V)
    want = draw(jnp.asarray(scaled), thr, cand_x, cand_i, greedy, row_keys(params.seed, positions))
    np.testing.assert_array_equal(out.tokens, np.asarray(want.tokens))
    np.testing.assert_array_equal(out.logprobs, np.asarray(want.logprobs))
    # Every finite top-k survivor is kept, the far tail included.
    survivors = np.isfinite(scaled) & (scaled >= t_k[:, None])
    np.testing.assert_array_equal(probs > 0, survivors)
