"""A prompt pass that would not fit the device's memory fails before it runs, saying so.

XLA knows, once a program is compiled, how much memory its temporaries and outputs take
(`compiled.memory_analysis()`), and a GPU or TPU says how much it holds and has in use
(`device.memory_stats()`). For a long prompt (`LONG_PROMPT_TOKENS` prompt tokens in the
batch or more) on a device that reports its memory, `checked_call` compiles the pass
first and compares the two, so a prompt that fits the model's context but not the device
raises a `ValueError` with both numbers instead of an allocation failure from inside XLA.
A CPU reports no memory limit (its programs share the host's memory with everything
else), and a short prompt's pass is small: both run unchecked, at no cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# Prompt tokens in a batch (rows x padded width) from which a pass is checked before it runs.
LONG_PROMPT_TOKENS = 8192
# Share of the device's free memory, once the weights are loaded, that the CLI's batch jobs
# give a paged KV pool by default (`default_kv_cache_tokens`); the rest is for the steps'
# temporaries (logits, the sampler's buffers, a prompt pass's activations).
KV_MEMORY_FRACTION = 0.8


def device_memory(device: Any = None) -> tuple[int, int] | None:
    """`(free, limit)` bytes of `device` (the default device), or None when it does not say."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    return limit - int(stats.get("bytes_in_use", 0)), limit


def default_kv_cache_tokens(
    kv_bytes_per_token: int | None,
    contiguous_tokens: int,
    page_size: int,
    memory: tuple[int, int] | None,
) -> int | None:
    """The CLI's `--kv-cache-tokens` when none is given: the tokens of keys and values
    (`kv_bytes_per_token` each) that `KV_MEMORY_FRACTION` of the device's free bytes
    (`memory`, from `device_memory()` after the weights are loaded) hold, in whole pages,
    when that is less than the job's contiguous slots need (`contiguous_tokens`: slots x
    (prompt bucket + buffer)). None, the contiguous slots as without the flag, when they
    fit, when the device does not report its memory (a CPU) or for a model without a
    paged cache."""
    if memory is None or not kv_bytes_per_token:
        return None
    free, _ = memory
    fits = int(KV_MEMORY_FRACTION * free) // kv_bytes_per_token // page_size * page_size
    if fits >= contiguous_tokens:
        return None
    return max(fits, page_size)


def check_fits(compiled: Any, what: str, memory: tuple[int, int]) -> None:
    """Raise a ValueError when `compiled`'s temporaries and outputs exceed `memory`'s free
    bytes (its arguments are on the device already, so counted as in use)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    temp, out = int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
    free, limit = memory
    if temp + out > free:
        gib = 2**30
        raise ValueError(
            f"{what}: the prompt pass needs {(temp + out) / gib:.2f} GiB of device memory "
            f"({temp / gib:.2f} GiB of temporaries, {out / gib:.2f} GiB of outputs, the cache "
            f"among them), and the device has {free / gib:.2f} GiB free of {limit / gib:.2f} "
            "GiB; shorten the prompts, run fewer rows at once, or lower max_tokens"
        )


def checked_call(what: str, prompt_tokens: int, fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` for a jitted `fn` (with `.trace`), checked first by
    `check_fits` when `prompt_tokens` is long and the device reports its memory."""
    memory = device_memory() if prompt_tokens >= LONG_PROMPT_TOKENS else None
    if memory is not None:
        check_fits(fn.trace(*args, **kwargs).lower().compile(), what, memory)
    return fn(*args, **kwargs)
