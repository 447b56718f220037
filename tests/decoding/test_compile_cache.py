"""The persistent compilation cache (`logitloop.compile_cache`): the tokens of a run without
it, however its folder was left by an earlier run (missing, stale, corrupt or planted
entries), nothing read from it unpickled, and a folder other users can write to refused."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
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
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            np.testing.assert_array_equal(_tiny_run(x), want)  # a replaced entry reads back
        errors = [str(w.message) for w in seen if "persistent compilation cache" in str(w.message)]
        assert not errors, errors
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


# A fresh process that enables the cache in argv[1], runs one small program and the
# fixed-order probes (their record lives in the same folder), and prints the program's
# result; with argv[2] == "kill" it is killed in the middle of writing the program's entry
# (the kernel's SIGXFSZ at 256 bytes, with whatever writes it); with "read-only" every write
# it tries in the folder fails (PermissionError).
_CHILD = """
import os, signal, sys, warnings
warnings.simplefilter("always")
folder, mode = sys.argv[1], sys.argv[2]
import jax, jax.numpy as jnp
import logitloop as ll
from logitloop.models import fixed_order
def writes_here(event, args):
    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    return event == "open" and str(args[0]).startswith(folder) and (args[2] or 0) & flags
def refuse(event, args):
    if writes_here(event, args):
        raise PermissionError(13, "Permission denied", args[0])
if mode == "read-only":
    sys.addaudithook(refuse)
cache = ll.enable_compile_cache()
print("cache", "on" if cache else "off")
if mode == "kill":  # files end at 256 bytes: the first write past that kills (SIGXFSZ)
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (EFBIG instead)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
print("result", jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) + 1.0)(x).tolist())
if mode != "kill":
    print("probe", fixed_order.measure([("float32", False, 16, 24)]))
"""


def _child(folder: Path, mode: str = "run") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "LOGITLOOP_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[2]))
    env["LOGITLOOP_COMPILE_CACHE"] = str(folder)  # the default folder too
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc past the "kill" child's file size limit
    cmd = [sys.executable, "-c", _CHILD, str(folder), mode]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _read_errors(proc) -> int:
    return proc.stderr.count("Error reading persistent compilation cache entry")


def test_killed_writers_truncated_entries_and_damaged_probe_records_in_fresh_processes(tmp_path):
    """A process killed while writing an entry leaves none half-written for the next one
    (JAX wrote entries in place); a truncated entry is read with JAX's warning by the next
    process, which replaces it, so the one after reads it cleanly (JAX kept the truncated
    entry, warned and compiled again in every process, forever); a probes.json that is
    not UTF-8, nests too deep or is a folder costs one warning and never fails the run (it
    raised UnicodeDecodeError and RecursionError)."""
    from logitloop.models import probe_record

    folder = tmp_path / "cc"
    record = folder / probe_record.FILE_NAME
    killed = _child(folder, "kill")
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert "cache on" in killed.stdout and "result" not in killed.stdout
    left = sorted(folder.glob(".*.partial"))  # the killed writer's (removed after an hour)

    record.write_bytes(b'{"format": "\xff"}')  # not UTF-8
    first = _child(folder)
    assert first.returncode == 0, first.stderr[-2000:]
    assert _read_errors(first) == 0, first.stderr[-2000:]  # nothing half-written was read
    assert first.stderr.count("fixed-order probe record") == 1, first.stderr[-2000:]
    assert json.loads(record.read_text())["format"] == probe_record.FORMAT  # replaced
    want = [line for line in first.stdout.splitlines() if line.startswith(("result", "probe"))]
    assert len(want) == 2
    entries = [p for p in _entries(folder) if p.name.endswith("-cache")]
    assert entries
    for path in entries:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    record.write_text("[" * 200_000)  # nested too deep for the parser
    second = _child(folder)
    assert second.returncode == 0 and _read_errors(second) >= 1, second.stderr[-2000:]
    assert second.stderr.count("fixed-order probe record") == 1, second.stderr[-2000:]

    record.unlink()
    record.mkdir()  # a folder in the file's place: read and write fail, one warning
    third = _child(folder)
    assert third.returncode == 0, third.stderr[-2000:]
    assert _read_errors(third) == 0, third.stderr[-2000:]  # the truncated entries replaced
    assert third.stderr.count("fixed-order probe record") == 1, third.stderr[-2000:]
    for proc in (second, third):
        got = [line for line in proc.stdout.splitlines() if line.startswith(("result", "probe"))]
        assert got == want
    assert sorted(folder.glob(".*.partial")) == left  # none left by a finished write


def test_a_read_only_folder_is_one_warning_and_no_cache(tmp_path):
    """A folder this process cannot write to is refused when enabled, with one warning
    (JAX warned once per program it failed to write), and the run goes on without a
    cache. (The child refuses itself every write in the folder, root included, which a
    read-only mount or permissions would refuse.)"""
    folder = tmp_path / "cc"
    folder.mkdir(mode=0o700)
    proc = _child(folder, "read-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cache off" in proc.stdout and "result" in proc.stdout
    assert proc.stderr.count("logitloop: compile cache") == 1, proc.stderr[-2000:]
    assert "cannot be created, read or written (Permission denied" in proc.stderr
    assert "Error writing persistent compilation cache" not in proc.stderr
    assert not any(folder.iterdir())


def test_a_relative_folder_is_made_absolute_once(tmp_path, monkeypatch):
    """`LOGITLOOP_COMPILE_CACHE=rel` (or a relative folder given) is the working directory's
    when first used, and stays that folder after a `chdir` (it followed the working
    directory, a new cache in every folder a job ran from)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, "rel-cache")
    monkeypatch.setattr(compile_cache, "_absolute", {})
    assert compile_cache.default_folder() == tmp_path / "rel-cache"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert compile_cache.default_folder() == tmp_path / "rel-cache"
    cache = ll.enable_compile_cache("given")
    try:
        assert cache.folder == tmp_path / "elsewhere" / "given"
        assert jax.config.jax_compilation_cache_dir == str(cache.folder)
        assert compile_cache.programs_folder() == cache.folder
    finally:
        cache.disable()
    assert compile_cache.programs_folder() != cache.folder
