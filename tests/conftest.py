"""Shared test fixtures."""

from __future__ import annotations

import jax
import pytest


class CompileCounter:
    """Counts XLA backend compilations (jax.monitoring events) while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.active = False

    def __call__(self, event, duration, **kwargs):
        if self.active and event == self.EVENT:
            self.count += 1

    def __enter__(self):
        self.count = 0
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


_COUNTER = CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER)


@pytest.fixture
def compile_counter() -> CompileCounter:
    """`with compile_counter as c: ...; assert c.count == 0`."""
    return _COUNTER
