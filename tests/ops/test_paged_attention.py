"""Paged decode attention (`logitloop.ops.attention.paged`).

The gather reference against float64 NumPy written token by token; the Pallas kernel
against the reference (`TestPagedKernel` compiled on a GPU, `TestPagedKernelInterpret` the
same tests in interpret mode here); the kernel lowered for CUDA from this CPU; dispatch and
bad input. Every case draws fresh inputs: ragged lengths (0, a page boundary, a full
table), grouped-query heads, pages in random order across the pool, one page named by two
rows, and garbage (-1 or any page) in the table entries a row does not read.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.ops.attention import paged

# (B, H, Hkv, D, page_size, pages_per_row): grouped-query, multi-head, one query per KV head.
SHAPES = {
    "gqa": (4, 6, 2, 16, 4, 5),
    "mha": (3, 2, 2, 32, 8, 3),
    "mqa": (2, 4, 1, 16, 2, 9),
    "long_pages": (4, 4, 2, 16, 16, 6),  # a page fills a kernel block (16 keys)
}
OPTIONS = {"plain": {}, "softcap": {"softcap": 3.0}, "window": {"window": 7}}


def _inputs(case: str, shape, dtype="float32"):
    """Random q, pools and tables of one shape: rows' live pages are distinct pages of the
    pool in random order, except that row 1's first page is row 0's first page (a shared
    full prefix page), and entries past a row's live pages are -1 or random pages."""
    b, h, hkv, d, ps, p = shape
    rng = np.random.default_rng(zlib.crc32(f"{case}{shape}{dtype}".encode()))
    lengths = rng.integers(1, p * ps + 1, size=b)
    lengths[0] = max(lengths[0], ps)  # row 0 holds a full first page
    lengths[-1] = 0 if b > 2 else p * ps  # a row with nothing, or a full table
    lengths[1] = ps if b > 3 else lengths[1]  # a row ending on a page boundary
    num_pages = b * p + 3
    order = rng.permutation(num_pages)
    tables = order[: b * p].reshape(b, p).copy()
    tables[1, 0] = tables[0, 0]
    live = -(-lengths // ps)
    for row in range(b):
        tables[row, live[row] :] = rng.choice([-1, int(rng.integers(0, num_pages))])
    q = rng.standard_normal((b, h, d))
    k = rng.standard_normal((hkv, num_pages, ps, d)) * 2
    v = rng.standard_normal((hkv, num_pages, ps, d))
    k[:, tables[0, 0]] = rng.standard_normal((hkv, ps, d))  # the shared page
    arrays = [jnp.asarray(a, dtype) for a in (q, k, v)]
    return (*arrays, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _numpy_attention(
    q, k_pages, v_pages, tables, lengths, starts=None, *, scale, softcap=None, window=None
):
    """Float64, one row and one head at a time, keys collected token by token."""
    q, k_pages, v_pages = (
        np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k_pages, v_pages)
    )
    b, h, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    out = np.zeros((b, h, d))
    for row in range(b):
        n = int(lengths[row])
        first = 0 if starts is None else max(int(starts[row]), 0)
        seen = [s for s in range(first, n) if window is None or s >= n - window]
        if not seen:
            continue
        for head in range(h):
            kv = head // (h // hkv)
            keys = np.stack([k_pages[kv, tables[row, s // ps], s % ps] for s in seen])
            values = np.stack([v_pages[kv, tables[row, s // ps], s % ps] for s in seen])
            scores = keys @ q[row, head] * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            w = np.exp(scores - scores.max())
            out[row, head] = (w / w.sum()) @ values
    return out


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64(shape, option):
    args = _inputs(f"ref-{option}", SHAPES[shape])
    kw = dict(scale=0.3, **OPTIONS[option])
    got = paged.paged_attention_reference(*args, **kw)
    want = _numpy_attention(*args, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, rtol=2e-6)
    assert not np.asarray(got)[np.asarray(args[-1]) == 0].any()  # a row with nothing: zeros


def test_reference_in_bfloat16_stays_close():
    """bfloat16 pools and query: the float32 softmax of the same rounded inputs."""
    args = _inputs("bf16", SHAPES["gqa"], "bfloat16")
    got = paged.paged_attention_reference(*args, scale=0.25, window=9)
    want = _numpy_attention(*args, scale=0.25, window=9)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)


def _starts(args):
    """Random first keys per row, some before the row's start, some at or past its end."""
    lengths = np.asarray(args[-1])
    rng = np.random.default_rng(int(lengths.sum()))
    return jnp.asarray(rng.integers(-2, lengths + 2), jnp.int32)


def test_starts_cut_each_row():
    """Per-row first keys (the layer's mask), with a window on top: the larger wins."""
    args = _inputs("starts", SHAPES["long_pages"])
    starts = _starts(args)
    got = paged.paged_attention_reference(*args, starts, scale=0.3, window=30)
    want = _numpy_attention(*args, starts, scale=0.3, window=30)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, rtol=2e-6)


def test_unread_table_entries_do_not_matter():
    """Entries past a row's live pages, and before its window, may name any page."""
    args = _inputs("unread", SHAPES["mqa"])
    q, k, v, tables, lengths = args
    want = paged.paged_attention_reference(*args, scale=0.3, window=3)
    first, end = paged.live_page_range(jnp.maximum(lengths - 3, 0), lengths, k.shape[2])
    i = jnp.arange(tables.shape[1])
    outside = (i < first[:, None]) | (i >= end[:, None])
    assert outside.any() and (i < first[:, None]).any()
    scrambled = jnp.where(outside, (tables * 7 + 3) % k.shape[1], tables)
    got = paged.paged_attention_reference(q, k, v, scrambled, lengths, scale=0.3, window=3)
    np.testing.assert_array_equal(got, want)


class TestPagedKernel:
    """The kernel compiled for the accelerator against the reference; skipped without a GPU."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip(
                "the compiled Pallas kernel needs a GPU (here, the Interpret subclass runs the "
                "same tests)"
            )

    def check(self, args, atol=2e-6, knobs=None, **kw):
        kw = dict(scale=0.3, **kw)
        want = paged.paged_attention_reference(*args, **kw)
        got = paged.paged_attention_pallas(*args, interpret=self.INTERPRET, **kw, **(knobs or {}))
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=atol
        )

    @pytest.mark.parametrize(("shape", "option"), [("gqa", "softcap"), ("mha", "window")])
    def test_matches_reference(self, shape, option):
        self.check(_inputs(f"kernel-{option}", SHAPES[shape]), **OPTIONS[option])

    def test_blocks_and_splits_do_not_change_the_result(self):
        """One page per block, two blocks per split: rows whose live pages end inside a
        split, splits that read nothing, and a window that starts mid-table."""
        args = _inputs("splits", SHAPES["long_pages"])
        self.check(args, window=21, knobs=dict(pages_per_block=1, max_splits=4))

    def test_default_blocks_on_a_long_table(self):
        """64 entries of 16-token pages: 8 pages a block, 8 splits, rows up to 1024 keys."""
        self.check(_inputs("long-table", (2, 2, 1, 16, 16, 64)), window=300)

    def test_starts(self):
        args = _inputs("kernel-starts", SHAPES["long_pages"])
        self.check((*args, _starts(args)), knobs=dict(pages_per_block=2, max_splits=2))

    def test_bfloat16(self):
        self.check(_inputs("kernel-bf16", SHAPES["gqa"], "bfloat16"), atol=2e-2)


class TestPagedKernelInterpret(TestPagedKernel):
    INTERPRET = True


def test_dispatch_picks_the_backend(monkeypatch):
    args = _inputs("dispatch", SHAPES["mha"])
    want = paged.paged_attention_reference(*args, scale=32**-0.5)
    np.testing.assert_array_equal(paged.paged_attention(*args, backend="xla"), want)
    got = paged.paged_attention(*args, backend="pallas", interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert paged.resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert paged.resolve_backend("auto") == "pallas"
    assert paged.resolve_backend("auto", sharded=True) == "xla"  # on a mesh
    # Shapes Triton cannot load take the XLA path ("auto") or are refused ("pallas").
    assert paged.resolve_backend("auto", head_dim=80) == "xla"
    assert paged.resolve_backend("auto", head_dim=128, page_size=12) == "xla"
    with pytest.raises(ValueError, match="got 80 and 16"):
        paged.paged_attention_pallas(
            jnp.zeros((1, 2, 80)),
            jnp.zeros((1, 4, 16, 80)),
            jnp.zeros((1, 4, 16, 80)),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones(1, jnp.int32),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="backend = 'triton' is not one of"):
        paged.paged_attention(*args, backend="triton")


@pytest.mark.parametrize("longest", [3, 16, 17, 40, 64])
def test_xla_path_reads_a_prefix_of_the_table(longest):
    """A 32-entry table whose longest row holds `longest` tokens (pages of 2): each
    prefix the XLA path may pick, against float64; garbage past the live pages."""
    q, k, v, tables, lengths = _inputs(f"prefix-{longest}", (3, 4, 2, 16, 2, 32))
    lengths = jnp.int32([longest, min(longest, 5), 1])
    past = jnp.arange(32)[None, :] >= (lengths[:, None] + 1) // 2
    tables = jnp.where(past, -1, tables)  # unread entries
    args = (q, k, v, tables, lengths)
    got = paged.paged_attention(*args, backend="xla", scale=0.3)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), _numpy_attention(*args, scale=0.3), atol=2e-6, rtol=2e-6
    )


def test_bad_input_names_the_argument():
    q, k, v, tables, lengths = _inputs("bad", SHAPES["gqa"])
    call = lambda *a, **kw: paged.paged_attention(*a, backend="xla", **kw)
    with pytest.raises(ValueError, match="q has 6 heads, not a multiple of the pages' 4"):
        call(q, jnp.tile(k, (2, 1, 1, 1)), jnp.tile(v, (2, 1, 1, 1)), tables, lengths)
    with pytest.raises(ValueError, match="k_pages and v_pages"):
        call(q, k, v[:, :1], tables, lengths)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(q, k, v, tables.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match=r"lengths must be int32 \[B=4\]"):
        call(q, k, v, tables, lengths[:2])
    with pytest.raises(ValueError, match="window = 0"):
        call(q, k, v, tables, lengths, window=0)
    with pytest.raises(ValueError, match="pages_per_block = 3 must be a positive power of two"):
        paged.paged_attention_pallas(q, k, v, tables, lengths, scale=1.0, pages_per_block=3)


@pytest.mark.parametrize(
    ("b", "h", "hkv", "d", "num_pages", "page_size", "pages_per_row", "dtype", "window"),
    [
        (8, 32, 8, 128, 4096, 16, 256, "bfloat16", None),  # Llama-3-8B-like, 4k tokens a row
        (3, 8, 8, 64, 100, 8, 5, "float32", 24),  # a small pool, a window, odd counts
        (1, 4, 1, 256, 64, 32, 2, "bfloat16", None),  # Gemma-like head dimension
    ],
)
def test_the_kernel_lowers_for_cuda(
    b, h, hkv, d, num_pages, page_size, pages_per_row, dtype, window
):
    s = jax.ShapeDtypeStruct
    pool = s((hkv, num_pages, page_size, d), dtype)
    args = (s((b, h, d), dtype), pool, pool, s((b, pages_per_row), jnp.int32), s((b,), jnp.int32))
    f = lambda *a: paged.paged_attention(*a, backend="pallas", window=window, softcap=30.0)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


# ------------------------------------------------------------------ shared prefixes (cascade)


def _grouped_inputs(case: str, groups=3, n=4, h=4, hkv=2, d=16, ps=4, entries=9, suffix=3):
    """Random q, pools and tables of `groups` groups of `n` rows: group u's rows share its
    first `count[u]` pages (0 to entries - suffix, in random order across the pool), then
    hold up to `suffix` pages of their own; one row has finished (length 0, no pages).
    Returns the arguments, the `SharedPrefix` and the counts."""
    b, width = groups * n, entries - suffix
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    num_pages = b * entries + 3
    order = iter(rng.permutation(num_pages).tolist())
    counts = rng.integers(0, width + 1, size=groups)
    counts[0] = width  # a group whose shared pages fill the descriptor
    prefix = np.full((groups, width), -1)
    tables = np.full((b, entries), -1)
    lengths = np.zeros(b, int)
    for u in range(groups):
        prefix[u, : counts[u]] = [next(order) for _ in range(counts[u])]
        for row in range(u * n, u * n + n):
            lengths[row] = counts[u] * ps + int(rng.integers(0, suffix * ps + 1))
            live = -(-lengths[row] // ps)
            tables[row, : counts[u]] = prefix[u, : counts[u]]
            tables[row, counts[u] : live] = [next(order) for _ in range(live - counts[u])]
    lengths[1], tables[1] = 0, -1  # a finished row
    q = rng.standard_normal((b, h, d))
    k = rng.standard_normal((hkv, num_pages, ps, d)) * 2
    v = rng.standard_normal((hkv, num_pages, ps, d))
    arrays = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    args = (*arrays, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32))
    shared = paged.SharedPrefix(
        jnp.asarray(prefix, jnp.int32), jnp.asarray(counts * ps, jnp.int32), suffix
    )
    return args, shared, counts


def _takes_the_cascade(args, prefix, starts=None, window=None) -> bool:
    """Whether `cascade_attention` runs its two parts (not the reference) on these rows."""
    q, k, v, tables, lengths = args
    first = paged.first_keys(lengths, window, starts)
    shared = paged.shared_entries(tables, first, prefix, k.shape[2])
    end = paged.live_page_range(first, lengths, k.shape[2])[1]
    return bool(jnp.all(end <= shared + prefix.suffix_entries))


@pytest.mark.parametrize("option", OPTIONS)
def test_cascade_matches_float64(option):
    """Groups sharing their first pages, a finished row, soft-capping, a window with
    per-row first keys: the cascade (read once per group, merged with each row's own
    pages) against float64 NumPy over each row's own table."""
    args, prefix, counts = _grouped_inputs(f"cascade-{option}")
    kw = dict(scale=0.3, **OPTIONS[option])
    starts = _starts(args) if option == "window" else None
    assert _takes_the_cascade(args, prefix, starts, kw.get("window"))
    got = paged.paged_attention(*args, starts, prefix=prefix, **kw)
    want = _numpy_attention(*args, starts, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, rtol=2e-6)
    assert not np.asarray(got)[1].any()  # the finished row: zeros


def test_cascade_reads_only_pages_a_row_holds():
    """A row that no longer holds its group's pages (given copies of its own, longer than
    the suffix bound) is not read through the group's pages: the batch takes the
    reference, and a group page scribbled over changes nothing for that row."""
    (q, k, v, tables, lengths), prefix, counts = _grouped_inputs("cascade-own")
    ps, width = k.shape[2], prefix.tables.shape[1]
    row = 2  # of group 0, whose pages fill the descriptor
    copies = jnp.arange(k.shape[1] - 3, k.shape[1])[:width]  # 3 spare pages
    assert counts[0] == width and width > copies.shape[0]
    tables = tables.at[row, : copies.shape[0]].set(copies)
    k = k.at[:, copies].set(k[:, prefix.tables[0, : copies.shape[0]]])
    v = v.at[:, copies].set(v[:, prefix.tables[0, : copies.shape[0]]])
    args = (q, k, v, tables, lengths)
    assert int(paged.shared_entries(tables, jnp.zeros_like(lengths), prefix, ps)[row]) == 0
    assert not _takes_the_cascade(args, prefix)
    got = paged.paged_attention(*args, prefix=prefix, scale=0.3)
    np.testing.assert_allclose(np.asarray(got, np.float64), _numpy_attention(*args, scale=0.3),
                               atol=2e-6, rtol=2e-6)  # fmt: skip


def test_cascade_bad_descriptor_names_the_field():
    args, prefix, _ = _grouped_inputs("cascade-bad")
    call = lambda p: paged.paged_attention(*args, prefix=p, scale=0.3)
    with pytest.raises(ValueError, match=r"rows \(12\) must be a multiple of the groups"):
        call(prefix.replace(tables=prefix.tables[:, :5].repeat(5, 0)[:5]))
    with pytest.raises(ValueError, match=r"prefix.lengths must be int32 \[U=3\]"):
        call(prefix.replace(lengths=prefix.lengths[:2]))
