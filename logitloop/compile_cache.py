"""An opt-in persistent compilation cache: compiled programs kept on disk between processes,
so that a second process neither compiles the decode loop nor its prefill again.

    import logitloop as ll
    cache = ll.enable_compile_cache()        # or enable_compile_cache("path/to/folder")
    model = ll.load_pretrained()
    ll.generate(model, ...)                  # compiles once, in the first process only
    cache.disable()                          # back to the settings before (optional)

It is JAX's own persistent compilation cache (`jax_compilation_cache_dir`), with every
program kept however quick it was to compile, the mechanism the `logitloop` command line
uses (`LOGITLOOP_COMPILE_CACHE`). No program is written anywhere until it is enabled. (The
folder also holds the deterministic mode's probe results, a small JSON file that is only
data: `logitloop.models.probe_record`; without a cache on none is read or kept.)

Entries are keyed by JAX on the lowered program, the compile options, the backend and the
jax/jaxlib versions, so an entry written by another version is never read; an entry that
cannot be read back (truncated, corrupt) is compiled again and replaced, with a warning
from JAX, so the process after reads it. Entries are written whole (`_WholeEntries`: a
temporary file renamed over the entry), so a process killed while writing one leaves no
half-written entry for the next to read. Nothing read from the folder is unpickled.

A compiled program is machine code, and JAX's documentation says so: "the compilation cache
is considered trusted". So a folder that other users can write to (the folder itself
group- or world-writable or owned by someone else, or inside a group- or world-writable
folder without the sticky bit) is refused with one warning, and no cache is used; so is a
folder this process cannot write to (read-only). A new folder is created readable and
writable by its owner only. A relative folder (or `LOGITLOOP_COMPILE_CACHE`) is taken
relative to the working directory when first used.

JAX's cache is keyed by the lowered program, so a warm process still traces and lowers
each program before the cache answers. The enabled folder therefore also holds logitloop's
store of executables (`executables/`, `logitloop.decoding.runtime.executables`), keyed by
what logitloop knows before tracing (its source, the versions, the backend, the model
described as data, the arguments' shapes): a warm process loads those programs without
tracing or lowering them. Its entries are a JSON header and XLA's bytes, nothing
unpickled; a bad or foreign entry is compiled again and replaced, with a warning.

(An earlier store, removed in 2026-12, unpickled what it read and wrote back executables
JAX had loaded from its cache, which could not run: XLA:CPU's copy of such an executable
lacks its kernels. The store compiles what it keeps with JAX's cache bypassed, and
serializes it before it first runs.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

COMPILE_CACHE_ENV = "LOGITLOOP_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no")
# The JAX settings `enable_compile_cache` sets (and `CompileCache.disable` restores).
_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)
_warned: set[str] = set()  # folders refused already in this process: one warning each
_absolute: dict[str, Path] = {}  # LOGITLOOP_COMPILE_CACHE's value -> its folder, made absolute
_active: CompileCache | None = None  # the cache enabled last (`active`)


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """The persistent compilation cache in use: `folder`, and the JAX settings it replaced
    (restored by `disable`)."""

    folder: Path
    previous: tuple[tuple[str, Any], ...]

    def disable(self) -> None:
        """Stop keeping programs on disk: JAX's settings as they were before."""
        global _active
        if _active is self:
            _active = None
        for name, value in self.previous:
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def default_folder() -> Path | None:
    """The folder `enable_compile_cache()` uses: `LOGITLOOP_COMPILE_CACHE` when it names one,
    None when it is "0"/"off"/"false"/"no", else the per-user cache folder
    (`$XDG_CACHE_HOME/logitloop/jax`, `~/.cache/logitloop/jax`)."""
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:  # a relative folder is the working directory's when first asked
        return _absolute.setdefault(value, Path(value).expanduser().absolute())
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "logitloop" / "jax"


def enable_compile_cache(folder: str | os.PathLike | None = None) -> CompileCache | None:
    """Keep compiled programs in `folder` (default: `default_folder()`) from now on, in this
    process and for the next ones that enable the same folder.

    Returns the `CompileCache` (its `disable()` undoes this), or None when no cache is used:
    `LOGITLOOP_COMPILE_CACHE` is off (and no folder was given), or the folder is refused
    because other users can write to it or it cannot be created (one warning per folder).
    """
    chosen = default_folder() if folder is None else Path(folder).expanduser().absolute()
    if chosen is None:
        return None
    refused = unsafe_folder(chosen)
    if refused is not None:
        key = str(chosen)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"logitloop: compile cache {chosen} not used: {refused}", stacklevel=2)
        return None
    previous = tuple((name, getattr(jax.config, name)) for name in _SETTINGS)
    jax.config.update("jax_compilation_cache_dir", str(chosen))
    jax.config.update("jax_enable_compilation_cache", True)
    # Every program, however quick to compile: the loop's small ones add up to seconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX reads its settings when it first compiles; a process that compiled before this
    # call would otherwise keep running without the cache.
    compilation_cache.reset_cache()
    _write_entries_whole(chosen)
    global _active
    _active = CompileCache(chosen, previous)
    return _active


def active() -> CompileCache | None:
    """The cache `enable_compile_cache` enabled and nothing disabled since (its folder
    also holds logitloop's executables, `decoding.runtime.executables`), or None."""
    return _active


def programs_folder() -> Path | None:
    """The local folder this process keeps its compiled programs in: JAX's persistent
    cache folder while that cache is on (`enable_compile_cache`'s, or one the process
    configured for JAX itself), else None."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or not jax.config.jax_enable_compilation_cache:
        return None
    if "://" in folder:  # a remote store (gs://...): JAX's business only
        return Path(folder.removeprefix("file://")) if folder.startswith("file://") else None
    return Path(folder)


def enable_default_compile_cache() -> CompileCache | None:
    """The cache a logitloop process that owns its model keeps by default (the command line,
    a Ray actor): `enable_compile_cache()` in `default_folder()` (so none when
    `LOGITLOOP_COMPILE_CACHE` is off), unless the process configured JAX's own cache
    (`JAX_COMPILATION_CACHE_DIR`, or `JAX_ENABLE_COMPILATION_CACHE=false`), which is left as
    it is. Returns the cache enabled here (None: none)."""
    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return None
    return enable_compile_cache()


def unsafe_folder(folder: Path) -> str | None:
    """Why `folder` must not hold compiled programs (created owner-only when absent), or
    None when it is this user's (or root's) and no other user can write to it, nor to a
    folder above it that lacks the sticky bit."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not folder.is_dir():
            return "it is not a folder"
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")  # read-only: OSError
        os.close(fd)
        os.unlink(probe)
        if not hasattr(os, "getuid"):  # no POSIX owners (Windows): the folder's ACLs rule
            return None
        me = os.getuid()
        path = folder.resolve()
        for place in (path, *path.parents):
            st = place.stat()
            writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if place == path and st.st_uid not in (me, 0):
                return f"{place} belongs to another user (uid {st.st_uid})"
            # Above the folder, the sticky bit (/tmp) keeps others from renaming our entries;
            # in the folder itself, others could still add entries.
            if writable and (place == path or not st.st_mode & stat.S_ISVTX):
                return (
                    f"other users can write to {place} (mode {stat.filemode(st.st_mode)}); "
                    f"a compiled program is code this process runs (chmod go-w {place})"
                )
    except OSError as e:
        return f"it cannot be created, read or written ({e.strerror or e})"
    return None


# ------------------------------------------------------------------- entries written whole

_PARTIAL = ".partial"  # a temporary entry's suffix (JAX's own files end in -cache, -atime)


class _WholeEntries:
    """JAX's file cache (`jax._src.lru_cache.LRUCache`) with each entry written whole: into
    a temporary file in the folder, renamed over the entry, replacing what was there. JAX
    writes an entry after compiling the program, so after finding none or failing to read
    the one there (truncated by a process killed while writing it, corrupt): JAX's own
    `put` keeps an existing entry and writes in place, so such an entry was read, warned
    about and compiled again by every later process. A size-bounded cache
    (`jax_compilation_cache_max_size`) keeps JAX's writes and bookkeeping; its unreadable
    entry is removed first, so it is replaced all the same."""

    def __init__(self, files: Any):
        self._files = files
        self._path = files._path  # what JAX's messages name
        self._folder = Path(str(files._path))

    def get(self, key: str) -> bytes | None:
        return self._files.get(key)

    def put(self, key: str, value: bytes) -> None:
        entry = self._folder / f"{key}-cache"
        if self._files.eviction_enabled:
            entry.unlink(missing_ok=True)
            self._files.put(key, value)
            return
        fd, partial = tempfile.mkstemp(dir=self._folder, prefix=f".{key[:48]}-", suffix=_PARTIAL)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            if entry.is_dir() and not entry.is_symlink():  # an empty folder in its place
                with contextlib.suppress(OSError):
                    entry.rmdir()
            os.replace(partial, entry)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise


def _write_entries_whole(folder: Path) -> None:
    """JAX's cache in `folder`, made now (as JAX would at its first compile) and wrapped in
    `_WholeEntries`; and the temporary entries of processes killed over an hour ago
    removed. This reaches into JAX's private `jax._src.compilation_cache` (jax 0.10): where
    that changed, JAX's own cache is left as it is (tests/decoding/test_compile_cache.py
    notices)."""
    for partial in folder.glob(f".*{_PARTIAL}"):
        with contextlib.suppress(OSError):
            if time.time() - partial.stat().st_mtime > 3600:
                partial.unlink()
    if jax.config.jax_compilation_cache_check_contents:
        return  # JAX's verifying cache: left as it is
    try:
        from jax._src import compilation_cache as jax_cache

        files, _ = jax_cache.get_file_cache(str(folder))
        if hasattr(files, "eviction_enabled") and jax_cache._cache is None:
            jax_cache._cache = _WholeEntries(files)
    except (ImportError, AttributeError, TypeError, ValueError):
        return
