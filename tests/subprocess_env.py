"""Environment for the tests' subprocesses (the CLI, `scripts/train_tiny.py`)."""

from __future__ import annotations


def jax_cache_env(folder: str) -> dict[str, str]:
    """The variables that point a JAX process at the persistent compilation cache in
    `folder` and store every program there, however small or quick to compile, so that only
    the first process to meet a program compiles it."""
    return {
        "JAX_COMPILATION_CACHE_DIR": folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
