"""Page bookkeeping (`logitloop.decoding.loop.pages`) against a plain-Python model of the pool.

Random sequences of allocate / free / fork / release_before run through the jitted
functions and through `PoolModel`, which keeps each row's list of pages and derives
everything else from them:
after every operation the tables, lengths and grants must be the model's, and the
reference counts must be the number of rows' entries naming each page (so no page is held
by two rows unless a fork shared it, and a freed page is free at once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logitloop.decoding.loop import pages

NUM_PAGES, ROWS, ENTRIES, PAGE_SIZE = 10, 4, 4, 2

_allocate = jax.jit(pages.allocate)
_free = jax.jit(pages.free)
_fork = jax.jit(pages.fork)
_release = jax.jit(pages.release_before)


class PoolModel:
    """Each row's pages as a Python list (None: released by a window); the lowest free pages
    go first, rows in order."""

    def __init__(self):
        self.rows = [[] for _ in range(ROWS)]
        self.lengths = [0] * ROWS

    def refs(self) -> list[int]:
        return [sum(row.count(p) for row in self.rows) for p in range(NUM_PAGES)]

    def allocate(self, lengths, order) -> list[bool]:
        free = [p for p, n in enumerate(self.refs()) if n == 0]
        granted, stopped = [False] * ROWS, False
        for b in order:
            length = max(lengths[b], self.lengths[b])
            want = -(-length // PAGE_SIZE)
            need = want - len(self.rows[b])
            ok = want <= ENTRIES and (need == 0 or (not stopped and need <= len(free)))
            if want <= ENTRIES and need > 0 and not ok:
                stopped = True
            if ok:
                self.rows[b] += free[:need]
                free = free[need:]
                self.lengths[b] = length
            granted[b] = ok
        return granted

    def free(self, rows):
        for b, drop in enumerate(rows):
            if drop:
                self.rows[b], self.lengths[b] = [], 0

    def fork(self, parents, children):
        before = [list(r) for r in self.rows], list(self.lengths)
        for b, child in enumerate(children):
            if child:
                full = before[1][parents[b]] // PAGE_SIZE
                self.rows[b] = before[0][parents[b]][:full]
                self.lengths[b] = full * PAGE_SIZE

    def release(self, starts):
        for b, start in enumerate(starts):
            behind = min(start // PAGE_SIZE, len(self.rows[b]))
            self.rows[b][:behind] = [None] * behind


def _assert_same(state: pages.PageState, model: PoolModel):
    tables, lengths = np.asarray(state.tables), np.asarray(state.lengths)
    assert lengths.tolist() == model.lengths
    for b, row in enumerate(model.rows):
        assert tables[b, : len(row)].tolist() == [pages.NO_PAGE if p is None else p for p in row]
        assert (tables[b, len(row) :] == pages.NO_PAGE).all()
    assert np.asarray(state.ref_counts).tolist() == model.refs()
    assert int(pages.free_pages(state)) == model.refs().count(0)


_rows = st.lists(st.booleans(), min_size=ROWS, max_size=ROWS)
_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("allocate"),
            st.lists(st.integers(0, 5), min_size=ROWS, max_size=ROWS),
            st.one_of(st.none(), st.permutations(range(ROWS))),
        ),
        st.tuples(st.just("free"), _rows),
        st.tuples(
            st.just("fork"),
            st.lists(st.integers(0, ROWS - 1), min_size=ROWS, max_size=ROWS),
            _rows,
        ),
        st.tuples(
            st.just("release"),
            st.lists(st.integers(0, ENTRIES * PAGE_SIZE), min_size=ROWS, max_size=ROWS),
        ),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops=_ops)
def test_random_operations_match_the_pool_model(ops):
    """`allocate` grows each row by 0-5 tokens, rows in row order or a random order; `free`
    and `fork` take random rows; `release_before` random positions."""
    state = pages.init_pages(NUM_PAGES, ROWS, ENTRIES, PAGE_SIZE)
    model = PoolModel()
    for op in ops:
        if op[0] == "allocate":
            lengths = [n + g for n, g in zip(model.lengths, op[1], strict=True)]
            if op[2] is None:
                state, granted = _allocate(state, jnp.asarray(lengths, jnp.int32))
            else:
                order = jnp.asarray(op[2], jnp.int32)
                state, granted = _allocate(state, jnp.asarray(lengths, jnp.int32), order)
            assert np.asarray(granted).tolist() == model.allocate(lengths, op[2] or range(ROWS))
        elif op[0] == "free":
            state = _free(state, jnp.asarray(op[1]))
            model.free(op[1])
        elif op[0] == "fork":
            state = _fork(state, jnp.asarray(op[1], jnp.int32), jnp.asarray(op[2]))
            model.fork(op[1], op[2])
        else:
            state = _release(state, jnp.asarray(op[1], jnp.int32))
            model.release(op[1])
        _assert_same(state, model)


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), min_size=ROWS, max_size=ROWS),
            st.one_of(st.none(), st.permutations(range(ROWS))),
            _rows,
        ),
        min_size=1,
        max_size=8,
    )
)
def test_shards_are_pools_of_their_own(ops):
    """`shards=2`: rows 0-1 hold pages 0-4 only and rows 2-3 pages 5-9, each block served
    as an unsharded pool of its rows and pages would be (in the order's order within it),
    whatever the other block does. Each op grows the rows by 0-5 tokens, then frees some."""
    half, block_pages = ROWS // 2, NUM_PAGES // 2
    state = pages.init_pages(NUM_PAGES, ROWS, ENTRIES, PAGE_SIZE, shards=2)
    blocks = [pages.init_pages(block_pages, half, ENTRIES, PAGE_SIZE) for _ in range(2)]
    for grow, order, drop in ops:
        lengths = np.asarray(state.lengths) + np.asarray(grow)
        ordered = None if order is None else jnp.asarray(order, jnp.int32)
        state, granted = _allocate(state, jnp.asarray(lengths, jnp.int32), ordered)
        tables = np.asarray(state.tables)
        for i in range(2):
            rows = slice(i * half, (i + 1) * half)
            mine = None if order is None else [b - i * half for b in order if b // half == i]
            mine = None if mine is None else jnp.asarray(mine, jnp.int32)
            blocks[i], want = _allocate(blocks[i], jnp.asarray(lengths[rows], jnp.int32), mine)
            assert np.asarray(granted)[rows].tolist() == np.asarray(want).tolist()
            local = np.asarray(blocks[i].tables)
            assert (tables[rows] == np.where(local >= 0, local + i * block_pages, -1)).all()
            held = np.asarray(state.ref_counts)[i * block_pages : (i + 1) * block_pages]
            assert held.tolist() == np.asarray(blocks[i].ref_counts).tolist()
            blocks[i] = _free(blocks[i], jnp.asarray(drop[rows]))
        state = _free(state, jnp.asarray(drop))
        free = [int(pages.free_pages(b)) for b in blocks]
        assert np.asarray(pages.free_by_shard(state)).tolist() == free


def test_host_counts_compile_nothing(compile_counter):
    """A job reads the pool's free pages on the host after each chunk: counted there in
    NumPy, equal to the program's counts, with no eager program (one per shape, each a
    compile in a first evaluation)."""
    state = pages.init_pages(NUM_PAGES, ROWS, ENTRIES, PAGE_SIZE, shards=2)
    state, _ = _allocate(state, jnp.int32([5, 0, 9, 3]))
    on_device = (int(jax.jit(pages.free_pages)(state)), jax.jit(pages.free_by_shard)(state))
    host = jax.device_get(state)
    with compile_counter as c:
        free, by_shard = pages.free_pages(host), pages.free_by_shard(host)
    assert c.count == 0 and isinstance(by_shard, np.ndarray)
    assert int(free) == on_device[0] and by_shard.tolist() == np.asarray(on_device[1]).tolist()


def test_freed_pages_go_to_the_next_request_at_once():
    state = pages.init_pages(4, 2, 4, 4)
    state, granted = _allocate(state, jnp.int32([16, 0]))
    assert granted.tolist() == [True, True] and int(pages.free_pages(state)) == 0
    state, granted = _allocate(state, jnp.int32([16, 1]))
    assert granted.tolist() == [True, False]  # the pool is dry: row 1 is refused, unchanged
    state = _free(state, jnp.array([True, False]))
    state, granted = _allocate(state, jnp.int32([0, 9]))
    assert granted.tolist() == [True, True]
    assert state.tables[1, :3].tolist() == [0, 1, 2] and state.ref_counts.tolist() == [1, 1, 1, 0]


def test_fork_shares_full_pages_only():
    """The module docstring's example."""
    state = pages.init_pages(6, 2, 3, 4)
    state, _ = _allocate(state, jnp.int32([6, 3]))
    state = _fork(state, jnp.int32([0, 0]), jnp.array([False, True]))
    assert state.tables.tolist() == [[0, 1, -1], [0, -1, -1]]
    assert state.lengths.tolist() == [6, 4] and state.ref_counts.tolist() == [2, 1, 0, 0, 0, 0]
    state, granted = _allocate(state, jnp.int32([6, 6]))
    assert granted.all() and state.tables[1, :2].tolist() == [0, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 2, 4, 3), "page_size = 3 must be a positive power of two"),
        ((8, 2, 4, 0), "page_size = 0 must be a positive power of two"),
        ((0, 2, 4, 4), "num_pages = 0 must be at least 1"),
        ((8, 2, 0, 4), "pages_per_row = 0 must be at least 1"),
        ((9, 2, 4, 4, 2), "num_pages = 9 does not split into shards = 2 blocks"),
        ((8, 3, 4, 4, 2), "batch_size = 3 does not split into shards = 2 blocks"),
    ],
)
def test_bad_sizes_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        pages.init_pages(*args)


def test_a_row_refused_in_one_layer_group_is_unchanged_in_every_group():
    """Two layer groups (`pool.Pool.groups`): the second has one free page, so of two rows
    that each need a page (row 1 served first) row 1 takes it in both groups and row 0
    takes none in either, although the first group had pages for it."""
    from logitloop.decoding.loop import pool

    wide = pages.init_pages(NUM_PAGES, 2, ENTRIES, PAGE_SIZE)
    narrow = pages.init_pages(3, 2, ENTRIES, PAGE_SIZE)
    grow = jax.jit(pool._allocate)
    (wide, narrow), _ = grow((wide, narrow), jnp.array([0, 4]))  # 2 of 3 narrow pages held
    (wide, narrow), granted = grow((wide, narrow), jnp.array([1, 5]), jnp.array([1, 0]))
    assert granted.tolist() == [False, True]
    for state in (wide, narrow):
        assert state.lengths.tolist() == [0, 5]
        assert int(jnp.sum(state.tables[0] >= 0)) == 0
    assert [int(pages.free_pages(s)) for s in (wide, narrow)] == [NUM_PAGES - 3, 0]
