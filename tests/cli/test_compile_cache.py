"""The CLI keeps compiled programs between runs (JAX's persistent compilation cache,
`logitloop.compile_cache`, and logitloop's store of executables beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from logitloop import cli


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop(cli.COMPILE_CACHE_ENV, None)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cli.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.compile_cache_dir() == tmp_path / "logitloop" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cli.compile_cache_dir() == Path.home() / ".cache" / "logitloop" / "jax"
    monkeypatch.setenv(cli.COMPILE_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cli.compile_cache_dir() == tmp_path / "elsewhere"
    for off in ("0", "off", "OFF", "false", "no"):
        monkeypatch.setenv(cli.COMPILE_CACHE_ENV, off)
        assert cli.compile_cache_dir() is None


def test_a_run_fills_the_cache_and_a_second_reads_it(tmp_path, model_args):
    folder = tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "logitloop",
        "generate",
        "The for",
        "--max-tokens",
        "3",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "-q",
        *model_args,
    ]
    env = _env(LOGITLOOP_COMPILE_CACHE=str(folder))
    first = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    assert folder.is_dir() and any(folder.iterdir()), "no compiled program was kept"
    stored = sorted(folder.iterdir())
    loud = [c for c in cmd if c != "-q"]  # with its summary line
    second = subprocess.run(loud, env=env, check=True, capture_output=True, text=True, timeout=600)
    assert second.stdout == first.stdout and first.stdout.strip()
    assert sorted(folder.iterdir()) == stored  # nothing compiled again
    # The programs come whole from logitloop's store (`executables`), read ahead from the
    # first run's record while the model loads.
    assert "0 programs compiled, 2 loaded in " in second.stderr, second.stderr[-2000:]
    assert (folder / "executables" / "cli-generate.first").is_file()
    assert (folder.stat().st_mode & 0o777) == 0o700  # the user's alone


def test_the_flag_turns_the_cache_off():
    args = cli.build_parser().parse_args(["generate", "x", "--no-compile-cache"])
    assert args.compile_cache is False
    assert cli.build_parser().parse_args(["generate", "x"]).compile_cache is True
