"""The CLI's persistent compilation cache: `logitloop.compile_cache` (JAX's own cache, every
program kept), in the folder `LOGITLOOP_COMPILE_CACHE` names, so that a second
`logitloop generate "..."` compiles nothing again."""

from __future__ import annotations

from logitloop.compile_cache import (
    COMPILE_CACHE_ENV,
    CompileCache,
    enable_default_compile_cache,
)
from logitloop.compile_cache import default_folder as compile_cache_dir

__all__ = ["COMPILE_CACHE_ENV", "compile_cache_dir", "use_compile_cache"]


def use_compile_cache(enabled: bool, command: str | None = None) -> CompileCache | None:
    """Turn on the persistent compilation cache in `compile_cache_dir()` (`enabled`, and
    `LOGITLOOP_COMPILE_CACHE` is not off); the returned object is the cache in use (None:
    none). A cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`, or
    `JAX_ENABLE_COMPILATION_CACHE=false`) is left as it is. `command`: the CLI's command,
    whose first programs the executable store starts reading ahead
    (`executables.read_ahead`)."""
    import jax

    if not enabled or compile_cache_dir() is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    cache = enable_default_compile_cache()
    if cache is not None and command is not None:
        from logitloop.decoding.runtime import executables

        # The programs the last such run got first deserialize while the model loads.
        executables.read_ahead(f"cli-{command}")
    return cache
