"""The persistent compilation cache (`logitloop.compile_cache`): the tokens of a run without
it, however its folder was left by an earlier run (missing, stale, corrupt or planted
entries), nothing read from it unpickled, and a folder other users can write to refused."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import logitloop as ll
from logitloop import compile_cache

from .random_llama import small_llama

PARAMS = dict(temperature=[0.0, 0.9], top_p=[1.0, 0.8], seed=[0, 3], max_tokens=[4, 5])


def _tiny(x):
    return jnp.tanh(x @ x.T).sum(axis=0) + 1.0  # [N, N] -> [N]


def _tiny_run(x):
    jax.clear_caches()  # a fresh process: nothing compiled in memory
    return np.asarray(jax.jit(_tiny)(x))


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "-atime" not in p.name)


class _Planted:
    """A pickle that, once loaded, leaves a file behind (the attacker's code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# Where to cut or flip, as a fraction of the entry's length in 1/65536ths: an entry's size
# (and the number of entries) varies from run to run, and hypothesis replays a failing case
# only if what it draws does not depend on such outside state.
_AT = st.integers(0, (1 << 16) - 1)


def _pick(items_or_length, draw):
    """One index into something whose length varies run to run, drawn as a fraction."""
    return draw(_AT) * items_or_length >> 16


def _damage(path: Path, how: str, draw, marker: Path) -> None:
    if not path.is_file():
        return  # made a folder by an earlier damage
    body = path.read_bytes()
    if how == "truncate":
        path.write_bytes(body[: _pick(len(body), draw)])
    elif how == "flip" and body:
        at = _pick(len(body), draw)
        path.write_bytes(body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :])
    elif how == "random":
        path.write_bytes(draw(st.binary(min_size=1, max_size=4096)))
    elif how == "pickle":
        path.write_bytes(pickle.dumps(_Planted(marker)))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "folder":
        path.unlink()
        path.mkdir()


_HOW = st.sampled_from(["truncate", "flip", "random", "pickle", "empty", "folder"])


@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(damage=st.lists(_HOW, min_size=1, max_size=3), data=st.data())
def test_damaged_entries_never_crash_a_run_nor_run_code(tmp_path, damage, data):
    x = np.random.default_rng(len(damage)).normal(size=(8, 8)).astype(np.float32)
    want = _tiny_run(x)
    folder = tmp_path / f"cc{len(list(tmp_path.iterdir()))}"
    marker = folder.parent / f"{folder.name}.pwned"
    cache = ll.enable_compile_cache(folder)
    try:
        np.testing.assert_array_equal(_tiny_run(x), want)
        entries = _entries(folder)
        assert entries, "nothing was kept"
        for how in damage:
            _damage(entries[_pick(len(entries), data.draw)], how, data.draw, marker)
        np.testing.assert_array_equal(_tiny_run(x), want)
        np.testing.assert_array_equal(_tiny_run(x), want)  # a replaced entry reads back
        assert not marker.exists(), "an entry of the cache was unpickled"
    finally:
        cache.disable()
        jax.clear_caches()


@pytest.mark.slow  # three generate calls traced and compiled afresh: 25-60 s
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_generate_runs_after_runs_and_planted_entries(tmp_path):
    # The old program store failed on the third run (NOT_FOUND: a program written back from
    # an executable JAX had loaded from its cache could not run), and unpickled its files.
    model = small_llama(64, 64, seed=5)
    cache = ll.enable_compile_cache(tmp_path / "cc")
    marker = tmp_path / "pwned"
    try:
        first = _run(model)
        entries = _entries(cache.folder)
        assert entries, "nothing was kept"
        assert _run(model) == first
        for path in entries[::2]:
            path.write_bytes(pickle.dumps(_Planted(marker)))
        assert _run(model) == first
        assert not marker.exists(), "an entry of the cache was unpickled"
    finally:
        cache.disable()
        jax.clear_caches()


def _run(model):
    jax.clear_caches()
    params = ll.SamplingParams.create(2, **PARAMS)
    r = ll.generate(model, [[1, 2, 3], [4, 5]], params)
    return r.token_ids, r.finish_reason


def test_a_folder_others_can_write_to_is_refused_once(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_warned", set())
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(UserWarning, match="other users can write to"):
        assert ll.enable_compile_cache(shared) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ll.enable_compile_cache(shared) is None  # no second warning
    assert jax.config.jax_compilation_cache_dir == before

    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.warns(UserWarning, match="other users can write to"):
        assert ll.enable_compile_cache(group / "inside") is None  # no sticky bit above


def test_a_new_folder_is_its_owners_alone(tmp_path):
    cache = ll.enable_compile_cache(tmp_path / "a" / "b")
    try:
        assert cache is not None
        assert (cache.folder.stat().st_mode & 0o777) == 0o700
    finally:
        cache.disable()
    assert jax.config.jax_compilation_cache_dir is None or not (
        jax.config.jax_compilation_cache_dir.startswith(str(tmp_path))
    )


def test_the_environment_turns_the_default_folder_off(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, "off")
    assert compile_cache.default_folder() is None
    assert ll.enable_compile_cache() is None
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, str(tmp_path / "here"))
    assert compile_cache.default_folder() == tmp_path / "here"
