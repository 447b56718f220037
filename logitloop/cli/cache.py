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


def use_compile_cache(enabled: bool) -> CompileCache | None:
    """Turn on the persistent compilation cache in `compile_cache_dir()` (`enabled`, and
    `LOGITLOOP_COMPILE_CACHE` is not off); the returned object is the cache in use (None:
    none). A cache the user configured for JAX (`JAX_COMPILATION_CACHE_DIR`, or
    `JAX_ENABLE_COMPILATION_CACHE=false`) is left as it is."""
    import jax

    if not enabled or compile_cache_dir() is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    return enable_default_compile_cache()
