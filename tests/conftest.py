"""Shared test fixtures."""

from __future__ import annotations

import pytest

from logitloop.decoding.compiles import CompileWatch


@pytest.fixture
def compile_counter() -> CompileWatch:
    """`with compile_counter as c: ...; assert c.count == 0`."""
    return CompileWatch()
