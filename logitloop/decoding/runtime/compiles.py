"""Counting and timing JAX compilations, from `jax.monitoring` events.

    with CompileWatch() as watch:
        ll.generate(model, prompts, params)
    watch.count    # XLA backend compilations while active (0: everything was cached)
    watch.seconds  # wall time spent tracing, lowering and compiling

The CLI reports `seconds`; the tests and benchmarks assert on `count` ("changing a value
compiles nothing"). One listener is registered for the process, the first time a watch is
entered; watches may nest (each sees the events while it is active).
"""

from __future__ import annotations

import math
import time

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE,
)

_active: list[CompileWatch] = []
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event not in COMPILE_EVENTS or not _active:
        return
    now = time.perf_counter()
    for watch in _active:
        watch.intervals.append((now - duration, now))
        watch.count += event == BACKEND_COMPILE


class CompileWatch:
    """Compilations while active: `count` (backend compiles) and `seconds` (trace + lower +
    compile; overlapping intervals, a nested jit traced inside another, merged)."""

    def __init__(self):
        self.count = 0
        self.intervals: list[tuple[float, float]] = []

    def __enter__(self) -> CompileWatch:
        global _registered
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        self.count = 0
        self.intervals = []
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)

    @property
    def seconds(self) -> float:
        total, end = 0.0, -math.inf
        for a, b in sorted(self.intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total
