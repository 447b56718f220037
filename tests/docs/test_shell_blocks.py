"""Every ```bash block of README.md and docs/*.md runs, line by line, as written, unless its
fence is marked `notest` (pytest-markdown-docs' marker, which conftest.py's collector of the
Python blocks honours). `logitloop` on the PATH is this checkout's (`python -m logitloop`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from markdown_it import MarkdownIt

from tests.docs import DOC_FILES, ROOT

SHELLS = ("bash", "sh", "shell", "console")


def shell_blocks() -> list:
    blocks = []
    for path in DOC_FILES:
        for token in MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8")):
            words = token.info.split()
            if token.type == "fence" and words and words[0] in SHELLS and "notest" not in words:
                name = f"{path.relative_to(ROOT)}:{token.map[0] + 1}"
                blocks.append(pytest.param(token.content, id=name))
    return blocks


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "logitloop"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m logitloop "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, JAX_PLATFORMS="cpu", LOGITLOOP_COMPILE_CACHE="off")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("script", shell_blocks())
def test_shell_block_runs(script, shell_env):
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=shell_env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{script}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
