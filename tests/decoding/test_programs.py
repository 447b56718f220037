"""Stored programs (`logitloop.decoding.runtime.programs`, the CLI's second run): the same tokens as
plain `jax.jit`, read back without tracing or compiling, and compiled again when a file is
absent, corrupt or stale."""

from __future__ import annotations

import pytest

import logitloop as ll
from logitloop.decoding.runtime import programs

from .random_llama import small_llama

V = 64
REQUESTS = [
    ll.Request([1, 2, 3], dict(temperature=0.0, max_tokens=6)),
    ll.Request([4, 5], dict(temperature=0.9, top_p=0.8, seed=3, max_tokens=9, logprobs=2)),
    ll.Request([6, 7, 8, 9], dict(temperature=1.3, top_k=5, seed=11, max_tokens=5)),
]


@pytest.fixture(scope="module")
def model():
    return small_llama(V, 64, seed=5)


@pytest.fixture(autouse=True)
def no_store():
    programs.use_program_store(None)
    yield
    programs.use_program_store(None)


def _run(model):
    """One `generate` call: its decode loop is a stored program (its prefill is not)."""
    params = ll.SamplingParams.create(
        3, temperature=[0.0, 0.9, 1.3], top_p=[1.0, 0.8, 1.0], top_k=[0, 0, 5], seed=[0, 3, 11],
        max_tokens=[6, 9, 5], logprobs=2,
    )
    r = ll.generate(model, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], params)
    return r.token_ids, r.finish_reason, r.logprobs


def _files(folder):
    return sorted(folder.glob("*.executable"))


@pytest.fixture(scope="module")
def plain(model):
    programs.use_program_store(None)
    return _run(model)


def test_stored_programs_give_the_tokens_of_plain_jit(model, plain, tmp_path, monkeypatch):
    programs.use_program_store(tmp_path)
    assert _run(model) == plain
    written = _files(tmp_path)
    assert len(written) == 1, written
    stamp = written[0].stat().st_mtime_ns

    # A fresh process (nothing in memory) reads it back: nothing is traced or compiled.
    programs.use_program_store(tmp_path)

    def no_compile(*args, **kwargs):
        raise AssertionError("a stored program was compiled again")

    monkeypatch.setattr(programs, "_compile", no_compile)
    assert _run(model) == plain
    assert [p.stat().st_mtime_ns for p in _files(tmp_path)] == [stamp]


def test_continuous_batching_stores_its_three_programs(model, tmp_path):
    def run():
        results = ll.generate_many(model, REQUESTS, slots=2, chunk_steps=4)
        return [(r.token_ids, r.finish_reason, r.logprobs) for r in results]

    want = run()
    programs.use_program_store(tmp_path)
    assert run() == want
    assert len(_files(tmp_path)) == 3  # the empty state, admission, decode


def test_a_corrupt_or_stale_program_is_traced_again(model, plain, tmp_path, monkeypatch):
    (path,) = _stored(model, tmp_path)
    path.write_bytes(path.read_bytes()[:100])  # a run killed mid-write, say
    programs.use_program_store(tmp_path)
    assert _run(model) == plain
    assert programs._read(path) is not None

    # Another logitloop source (or jax, or device): another key, the old file is unused.
    monkeypatch.setattr(programs, "_environment", lambda: ("another source",))
    programs.use_program_store(tmp_path)
    assert _run(model) == plain
    assert len(_files(tmp_path)) == 2


def _stored(model, folder):
    programs.use_program_store(folder)
    _run(model)
    return _files(folder)


def test_no_store_writes_nothing(model, plain, tmp_path):
    assert programs.program_store() is None
    assert _run(model) == plain
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_store_runs_as_plain_jit(model, plain, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    programs.use_program_store(blocked / "programs")
    assert _run(model) == plain
    assert programs.program_store() is None


def test_the_cli_keeps_programs_beside_its_compile_cache(tmp_path, monkeypatch):
    import jax
    from jax._src import compilation_cache

    from logitloop.cli import cache

    monkeypatch.setenv(cache.COMPILE_CACHE_ENV, str(tmp_path / "cc"))
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    thresholds = (
        jax.config.jax_persistent_cache_min_compile_time_secs,
        jax.config.jax_persistent_cache_min_entry_size_bytes,
    )
    try:
        cache.use_compile_cache(False)
        assert programs.program_store() is None
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", None)
        cache.use_compile_cache(True)
        assert programs.program_store() == tmp_path / "cc" / cache.PROGRAMS
    finally:  # leave this worker as it was: no store, no cache folder (which pytest removes)
        programs.use_program_store(None)
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_enable_compilation_cache", saved[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", thresholds[0])
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", thresholds[1])
        compilation_cache.reset_cache()
