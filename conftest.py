"""Root test configuration: the compile-cache setting every test runs with, and the code
blocks of README.md and docs/ collected as tests (pytest-markdown-docs).

Every ```python block of README.md and docs/*.md is a test that runs it as written, in a
fresh namespace (pytest-markdown-docs' `MarkdownTextFile` collector, restricted here to those
Markdown files: its `--markdown-docs` flag would also import every `.py` file under the test
paths to read their docstrings). A block marked ```python notest (the plugin's mechanism;
mkdocs renders the marked fence through superfences' `relaxed_headers`) is not run. Shell
blocks are run by `tests/docs/test_shell_blocks.py`, under the same marker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# An in-process `cli.main` turns on JAX's persistent compilation cache (every program
# written) and the stored programs in the user's cache folder, for the rest of that pytest
# worker; so would `ll.enable_compile_cache()` in a documentation block. Tests run with it
# off; those about the cache set the variable themselves, and the CLI's subprocesses get
# their own shared cache (`tests/cli/test_cli.py`, `cli_env`).
os.environ.setdefault("LOGITLOOP_COMPILE_CACHE", "off")


def _fast_compiles() -> None:
    """Compile the tests' programs at LLVM -O0 with XLA:CPU's older fusion emitters: the
    tests check values, not speed, and most of a test's time is XLA:CPU compiling small
    programs (tests/lora/test_lora.py: 108 s of CPU time at the defaults, 51 s so).
    Neither option turns on fast math, so a program's operations and their order are its
    own; but without LLVM's optimizations XLA:CPU's `exp` and `log` round a little
    otherwise (a float32 log-probability moved by up to 3e-5 against transformers' where
    the defaults stay within 2e-5). So a test that pins a tolerance that tight is marked
    `default_codegen`: it runs in a subprocess at XLA's default options, as a user's
    process compiles (`pytest_pyfunc_call` below). The deterministic mode's programs set
    their own options, LLVM's default level among them (`numerics.CPU_COMPILER_OPTIONS`),
    so they compile as a user's do under these flags too. Set before JAX starts its CPU
    client (it reads XLA_FLAGS once) and inherited by every subprocess a test starts;
    only for the jaxlib releases these flags were tried with (XLA stops at an unknown
    flag); off with LOGITLOOP_TEST_XLA_FLAGS=off."""
    if not _fast_compiles_on():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()


def _fast_compiles_on() -> bool:
    if os.environ.get("LOGITLOOP_TEST_XLA_FLAGS", "").lower() in ("0", "off", "no"):
        return False
    from importlib.metadata import version

    return tuple(int(part) for part in version("jaxlib").split(".")[:2]) == (0, 10)


TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
_fast_compiles()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `default_codegen` runs again, alone, in a subprocess whose programs
    compile at XLA's default options (`_fast_compiles`); its result is that run's."""
    if pyfuncitem.get_closest_marker("default_codegen") is None or not _fast_compiles_on():
        return None
    import subprocess
    import sys

    env = dict(os.environ, LOGITLOOP_TEST_XLA_FLAGS="off", LOGITLOOP_TEST_COMPILE_CACHE="off")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    command += ["-m", "", pyfuncitem.nodeid]
    root = pyfuncitem.config.rootpath
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or " passed" not in proc.stdout:
        output = proc.stdout[-6000:] + proc.stderr[-3000:]
        pytest.fail(f"at XLA's default compile options:\n{output}")
    return True


from tests.docs import DOC_FILES  # noqa: E402

_LOADED = pytest.StashKey[dict]()  # (path, dtype) -> the model, for the documentation blocks


def _share_compiled_programs() -> None:
    """One persistent compilation cache per test run, shared by its xdist workers (they
    load the same models and compile many of the same programs; a worker then loads what
    the other compiled). An entry is keyed by the program, its compile options and the
    jax version, and it is the executable the compiler would make: every value a test
    checks, bit-exact ones included, is the same; compile-counting tests count JAX's compile
    events, which fire for a cache hit too. Off with LOGITLOOP_TEST_COMPILE_CACHE=off;
    folders of runs older than a day are removed."""
    if os.environ.get("LOGITLOOP_TEST_COMPILE_CACHE", "").lower() in ("0", "off", "no"):
        return
    import shutil
    import tempfile
    import time
    import uuid

    import jax

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
    base = Path(tempfile.gettempdir())
    for old in base.glob("logitloop-test-programs-*"):
        try:
            if time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    folder = base / f"logitloop-test-programs-{run[:16]}"
    folder.mkdir(mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_share_compiled_programs()


def pytest_collect_file(file_path: Path, parent):
    if Path(file_path) in DOC_FILES:
        from pytest_markdown_docs.plugin import MarkdownTextFile

        return MarkdownTextFile.from_parent(parent, path=Path(file_path))
    return None


@pytest.fixture(autouse=True)
def _one_load_per_checkpoint(request, monkeypatch):
    """In a documentation block, `ll.load_pretrained(path)` returns one model per (path,
    dtype) for the whole worker. Each block loads the model it uses, as a reader's script
    would; a second load of the same folder is an equal model, but a new graph definition
    for jit, which would compile every program again (15 s a block on 2 busy cores)."""
    if request.node.path not in DOC_FILES:
        return
    import logitloop

    load = logitloop.models.loading.load_pretrained
    loaded = request.config.stash.setdefault(_LOADED, {})

    def load_once(path=None, *, dtype=None):
        key = (None if path is None else str(Path(path).resolve()), str(dtype))
        if key not in loaded:
            loaded[key] = load(path, dtype=dtype)
        return loaded[key]

    monkeypatch.setattr(logitloop, "load_pretrained", load_once)
