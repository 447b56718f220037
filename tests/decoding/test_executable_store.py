"""The store of compiled executables (`logitloop.decoding.runtime.executables`): a second
process loads its programs without tracing them and generates the same tokens; a corrupt,
truncated or foreign (another jax version, another model) entry is refused with a warning
and compiled again; a folder that cannot be written warns once; a process killed while
writing leaves no entry. Two processes share the work (`store_run.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import logitloop as ll
from logitloop.decoding.runtime import executables

ROOT = Path(__file__).resolve().parents[2]


def _process(mode: str, folder: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "tests.decoding.store_run", mode, str(folder)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _json(done: subprocess.CompletedProcess, returncode: int = 0) -> dict:
    assert done.returncode == returncode, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    first = _json(_process("fill", folder))
    store = folder / executables.FOLDER
    entries = {p.name for p in store.glob("*.xla")}
    check = _json(_process("check", folder), returncode=-9)  # killed while writing, last
    return store, entries, first, check


def test_a_second_process_loads_its_programs_without_tracing(runs):
    _, entries, first, check = runs
    shipped, clean = first["shipped"], check["clean"]
    # `precompile` stored the programs `generate` then ran (structs and arrays alike)
    assert first["precompiled"] == {"programs": 2, "traces": 2}
    assert (shipped["compiled"], shipped["loaded"], shipped["traces"]) == (0, 0, 0), shipped
    assert (first["tiny"]["compiled"], first["tiny"]["traces"]) == (2, 2)
    assert len(entries) == 4
    assert (clean["compiled"], clean["loaded"], clean["traces"]) == (0, 2, 0), clean
    assert clean["tokens"] == shipped["tokens"]
    # decode was read ahead while prefill loaded (`prefill.next`, written by the first)
    assert clean["prefetched"] == ["decode"]
    assert clean["summary"].startswith("0 programs compiled, 2 loaded in ")
    assert not clean["warnings"]


def test_a_corrupt_entry_is_refused_compiled_again_and_replaced(runs):
    _, _, first, check = runs
    seen = check["flipped"]
    assert seen["tokens"] == first["shipped"]["tokens"]
    assert (seen["compiled"], seen["loaded"]) == (1, 1), seen  # prefill again, decode loaded
    (warning,) = seen["warnings"]
    assert "does not match its hash" in warning and "compiling it again" in warning
    assert check["flipped_replaced"] == 2  # the entry written again reads back


@pytest.mark.parametrize(
    "damage, says",
    [
        ("truncated", "truncated"),
        ("jax_version", 'environment.jax "0.4.0" (here "'),
        ("other_model", "written for another program: static.program"),
    ],
)
def test_a_truncated_or_foreign_entry_is_refused(runs, damage, says):
    seen = runs[3][damage]
    assert seen["refused"]
    (warning,) = seen["warnings"]
    assert says in warning and "compiling it again" in warning, warning


def test_a_folder_that_cannot_be_written_warns_once(runs):
    (warning,) = runs[3]["read_only"]
    assert "not kept" in warning and "Read-only file system" in warning


def test_a_process_killed_while_writing_leaves_no_entry(runs):
    store, entries, _, _ = runs
    after = {p.name for p in store.glob("*.xla")}
    assert len(after) == len(entries) - 1  # prefill's entry is not there, not even half
    (half,) = store.glob(".*.tmp")  # what it had written lies under another name
    assert half.stat().st_size > 0


def test_a_users_model_has_no_stable_key_and_a_family_one_has():
    """A user's functions and module classes are code logitloop cannot hash: their programs
    stay out of the store (traced as before); a family model's runner is described."""
    from logitloop.decoding.loop.runner import model_info
    from logitloop.decoding.runtime.stable_key import Unstable, describe
    from tests.decoding.random_llama import small_llama
    from tests.models import user_model
    from tests.models.test_own_model import NNXDecoder

    function_model = user_model.model()
    nnx_model = ll.from_nnx(
        NNXDecoder(user_model.init_params(0)), user_model.SPEC, vocab_size=user_model.V,
        max_length=64,
    )  # fmt: skip
    for model in (function_model, nnx_model):
        with pytest.raises(Unstable, match="not a module-level name of logitloop"):
            describe(model_info(model).runner)
    family = describe(model_info(small_llama(64, 64, seed=5)).runner)
    assert json.dumps(family) == json.dumps(describe(model_info(small_llama(64, 64, 5)).runner))
