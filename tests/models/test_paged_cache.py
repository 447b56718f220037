"""A paged KV cache in the model layer (`layers.init_paged_caches`, `write_pages`, the paged
branch of `cached_attention`) against today's contiguous cache.

A small random Llama (one full layer, one sliding-window layer, which the contiguous
cache keeps as a ring) runs a left-padded prefill and decode steps with both caches; the
paged rows take their pages from `logitloop.decoding.loop.pages` as they grow, so their pages
are interleaved across rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logitloop.decoding.loop import pages
from logitloop.decoding.loop.runner import model_info
from logitloop.models import LlamaModel, layers
from tests.decoding.random_llama import small_llama

VOCAB, ROWS, PAGE_SIZE, ENTRIES = 64, 3, 2, 16  # a paged row spans 32 slots, as the buffer


def _model(window: int | None = 5) -> LlamaModel:
    """`small_llama` with a window on its second layer (the window changes no weight)."""
    model = small_llama(VOCAB, 32, 0)
    model.config = dataclasses.replace(model.config, sliding_windows=(None, window))
    return model


# The deterministic case (slow: it repeats the gathered layout the prefill already takes)
# has no window: the contiguous cache keeps a window layer as a ring, whose sums differ.
@pytest.mark.parametrize(
    ("deterministic", "window"), [(False, 5), pytest.param(True, None, marks=pytest.mark.slow)]
)
def test_paged_cache_logits_equal_the_contiguous_cache(deterministic, window):
    """Prefill (rows of 5, 1 and 9 tokens) and four decode steps: the same logits within
    float32 rounding; with `deterministic=True` (every call then takes the gathered layout
    and the fixed-order sums) bit for bit."""
    model = _model(window)
    c = model.config
    info = model_info(model, deterministic=deterministic)
    step = jax.jit(lambda w, t, p, cache: info.runner.forward(w, t, p, cache))
    allocate = jax.jit(pages.allocate)
    rng = np.random.default_rng(11)

    contiguous = info.runner.init_cache(info.weights, ROWS, ENTRIES * PAGE_SIZE)
    state = pages.init_pages(ROWS * ENTRIES, ROWS, ENTRIES, PAGE_SIZE)
    paged = layers.init_paged_caches(
        c.num_layers,
        ROWS * ENTRIES,
        PAGE_SIZE,
        state.tables,
        c.num_kv_heads,
        c.head_dim,
        jnp.float32,
    )

    def run(tokens, positions, grow_order):
        nonlocal contiguous, paged, state
        lengths = np.array(state.lengths)
        for row in grow_order:  # one row at a time: pages interleave across rows
            lengths[row] = max(lengths[row], positions[row].max() + 1)
            state, granted = allocate(state, jnp.asarray(lengths, jnp.int32))
            assert bool(granted.all())
        paged = [dict(layer, tables=state.tables) for layer in paged]
        tokens, positions = jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
        want, contiguous = step(info.weights, tokens, positions, contiguous)
        got, paged = step(info.weights, tokens, positions, paged)
        if deterministic:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    prompt_lengths = np.array([5, 1, 9])
    positions = np.arange(9)[None, :] - (9 - prompt_lengths)[:, None]
    positions = np.where(positions >= 0, positions, -1)
    run(rng.integers(0, VOCAB, (ROWS, 9)), positions, [2, 0, 1])
    for _ in range(4):
        lengths = np.array(state.lengths)
        run(rng.integers(0, VOCAB, (ROWS, 1)), lengths[:, None], rng.permutation(ROWS))
    assert not np.array_equal(np.sort(np.asarray(state.tables[0, :3])), [0, 1, 2])


def test_write_pages_puts_each_token_in_its_rows_page():
    """Against a loop over tokens; padding, positions past the table and positions in an
    entry that names no page (-1) are dropped."""
    rng = np.random.default_rng(4)
    hkv, num_pages, ps, d = 2, 7, 4, 3
    pool = rng.standard_normal((hkv, num_pages, ps, d)).astype(np.float32)
    tables = np.array([[5, 1], [2, -1]], np.int32)  # row 1 holds one page
    positions = np.array([[-1, 0, 1, 2, 3, 4, 8], [3, 4, 5, 6, 7, -1, -1]], np.int32)
    values = rng.standard_normal((2, 7, hkv, d)).astype(np.float32)
    got = layers.write_pages(jnp.asarray(pool), jnp.asarray(values), positions, tables)
    want = pool.copy()
    for b in range(2):
        for t in range(7):
            p = positions[b, t]
            if 0 <= p < 2 * ps and tables[b, p // ps] >= 0:
                want[:, tables[b, p // ps], p % ps] = values[b, t]
    np.testing.assert_array_equal(got, want)


def test_a_paged_decode_step_lowers_for_cuda_with_the_kernel(monkeypatch):
    """On a GPU ("auto") a decode step's attention is the Pallas kernel (whose Triton loads
    need a head dimension of 16 or more: the small Llama's 8 is widened); with the rows
    over a mesh, the XLA path (GSPMD would run the kernel, a custom call, whole)."""
    config = dataclasses.replace(_model().config, head_dim=16)
    model = LlamaModel(config, rngs=nnx.Rngs(0))
    c = model.config
    info = model_info(model)
    state = pages.init_pages(ROWS * ENTRIES, ROWS, ENTRIES, PAGE_SIZE)
    cache = layers.init_paged_caches(
        c.num_layers,
        ROWS * ENTRIES,
        PAGE_SIZE,
        state.tables,
        c.num_kv_heads,
        c.head_dim,
        jnp.float32,
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    step = jax.jit(lambda w, t, p, cache: info.runner.forward(w, t, p, cache))
    tokens = jnp.zeros((ROWS, 1), jnp.int32)
    text = step.trace(info.weights, tokens, tokens, cache).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in text.as_text()
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    step = jax.jit(lambda w, t, p, cache: info.runner.forward(w, t, p, cache, mesh=mesh))
    text = step.trace(info.weights, tokens, tokens, cache).lower(lowering_platforms=("cuda",))
    assert "triton" not in text.as_text()


def test_a_forked_row_continues_as_its_parent():
    """n > 1 with shared pages: row 0 prefills 7 tokens (pages of 2: three full, one
    partial); row 1 forks it, sharing the three full pages, takes a page of its own for
    the partial one and copies it (`copy_pages`). Fed the same tokens, both rows give the
    same logits, and the shared pages stay shared."""
    model = _model()
    c = model.config
    info = model_info(model)
    step = jax.jit(lambda w, t, p, cache: info.runner.forward(w, t, p, cache))
    allocate = jax.jit(pages.allocate)
    rng = np.random.default_rng(5)
    state = pages.init_pages(2 * ENTRIES, 2, ENTRIES, PAGE_SIZE)
    state, _ = allocate(state, jnp.int32([7, 0]))
    cache = layers.init_paged_caches(
        c.num_layers,
        2 * ENTRIES,
        PAGE_SIZE,
        state.tables,
        c.num_kv_heads,
        c.head_dim,
        jnp.float32,
    )
    prompt = jnp.asarray(rng.integers(0, VOCAB, (2, 7)), jnp.int32)
    positions = jnp.stack([jnp.arange(7), jnp.full(7, -1)]).astype(jnp.int32)
    _, cache = step(info.weights, prompt, positions, cache)

    state = pages.fork(state, jnp.int32([0, 0]), jnp.array([False, True]))
    state, granted = allocate(state, jnp.int32([7, 7]))
    assert bool(granted.all()) and state.tables[0, :3].tolist() == state.tables[1, :3].tolist()
    cache = layers.copy_pages(cache, state.tables[0, 3:4], state.tables[1, 3:4])
    for _ in range(3):
        state, _ = allocate(state, state.lengths + 1)
        cache = [dict(layer, tables=state.tables) for layer in cache]
        token = jnp.full((2, 1), int(rng.integers(0, VOCAB)), jnp.int32)
        logits, cache = step(info.weights, token, state.lengths[:, None] - 1, cache)
        np.testing.assert_allclose(logits[1], logits[0], rtol=1e-6, atol=1e-6)
    assert (state.ref_counts[state.tables[0, :3]] == 2).all()
