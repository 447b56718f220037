"""Timing helpers shared by the benchmark scripts (run them as `python scripts/NAME.py`)."""

from __future__ import annotations

import statistics
import time

import jax


def first_call(fn) -> float:
    """Seconds of one call, results ready (the first call of a jitted function compiles)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def median_time(fn, repeats: int, warmup: int = 0) -> float:
    """Median seconds per call over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    return statistics.median(first_call(fn) for _ in range(repeats))
