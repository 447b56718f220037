"""The CLI's persistent compilation cache: compiled programs kept between runs (JAX's own
cache), and the compiled programs beside them (`logitloop.decoding.runtime.programs`, in
the folder's `programs/`), so that a second `logitloop generate "..."` neither traces, lowers nor
compiles its programs again."""

from __future__ import annotations

import os
from pathlib import Path

COMPILE_CACHE_ENV = "LOGITLOOP_COMPILE_CACHE"
PROGRAMS = "programs"  # the subfolder of compiled programs (`logitloop.decoding.runtime.programs`)


def compile_cache_dir() -> Path | None:
    """Where the CLI keeps JAX's compiled programs between runs, or None when it does not.

    `LOGITLOOP_COMPILE_CACHE`: a folder, or "0"/"off" to turn the cache off; unset: the
    per-user cache folder (`$XDG_CACHE_HOME/logitloop/jax`, `~/.cache/logitloop/jax`).
    """
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "logitloop" / "jax"


def use_compile_cache(enabled: bool) -> None:
    """Turn on JAX's persistent compilation cache (`enabled`, and the folder above is not
    off). A cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`, or
    `JAX_ENABLE_COMPILATION_CACHE=false`) is left as it is."""
    import jax

    from logitloop.decoding.runtime.programs import use_program_store

    folder = compile_cache_dir() if enabled else None
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        use_program_store(None)
        return
    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        use_program_store(None)
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # The loop's compiled programs too (`decoding/programs.py`), so a second run neither
    # traces, lowers nor compiles them.
    use_program_store(folder / PROGRAMS)
    # Every program, however quick to compile: the CLI's small ones add up to seconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
