"""The checkpoint the CLI tests run: the shipped model, unless LOGITLOOP_CLI_TEST_MODEL names
another checkpoint folder ("" = the shipped default)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_args() -> list[str]:
    path = os.environ.get("LOGITLOOP_CLI_TEST_MODEL")
    if not path:
        return []
    if not Path(path).is_dir():
        pytest.skip(f"LOGITLOOP_CLI_TEST_MODEL={path} is not a folder")
    return ["--model", path]
