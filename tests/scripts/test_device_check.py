"""scripts/device_check.py --smoke: every section runs at tiny shapes on this CPU (the
Pallas kernels interpreted) and leaves its row in the table, so the script a GPU or TPU
window depends on cannot rot between windows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import device_check  # noqa: E402 - a script, importable once scripts/ is on the path


def test_smoke_run_writes_every_sections_row(tmp_path):
    out = tmp_path / "check.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        # A budget no loaded machine exhausts: this test is about every row, and the
        # time-boxing has its own test below.
        [sys.executable, str(SCRIPTS / "device_check.py"), "--smoke", "--budget-s", "900"]
        + ["--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| section |")
    body = rows[1:]
    names = [f"{i} {name}" for i, name in enumerate(device_check.SECTIONS, 1)]
    assert [r.split(" | ")[0].removeprefix("| ") for r in body] == names
    status = {r.split(" | ")[0]: r.split(" | ")[-2] for r in body}
    # Everything ran and held, except what has not landed in this checkout.
    assert set(status.values()) <= {"ok", "not landed"}, body
    assert out.read_text() in run.stdout  # the same table on stdout


def test_a_section_out_of_time_says_so_and_the_next_runs(monkeypatch):
    """A section past its budget leaves a row saying so; a failing one an error row."""
    ck = device_check.Check(device_check.SMOKE, smoke=True)

    def slow(ck, row):
        row.add("first part done")
        while True:
            ck.check_time()

    def broken(ck, row):
        raise RuntimeError("kernel failed to compile\nlong XLA message")

    monkeypatch.setitem(device_check.RUN, "sampling", slow)
    monkeypatch.setitem(device_check.RUN, "decode", broken)
    row = device_check.run_section(ck, 2, "sampling", 0.2)
    assert row.status == "out of time" and row.parts[0] == "first part done"
    assert "budget of 0 s ran out" in row.markdown()
    row = device_check.run_section(ck, 3, "decode", 5.0)
    assert row.status == "error"
    assert row.parts == ["RuntimeError: kernel failed to compile"]


def test_sections_by_name_or_number_in_table_order():
    assert device_check.parse_sections(["7,1", "decode"]) == ["environment", "decode", "paged"]
    with pytest.raises(SystemExit, match="'9' is not one of 1-8 or"):
        device_check.parse_sections(["9"])


@pytest.mark.parametrize(
    ("kind", "bandwidth"),
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA A100-SXM4-80GB", 2.0e12),
        ("TPU v5 lite", 0.82e12),
        ("TPU v5", 2.76e12),
        ("TPU v6 lite", 1.64e12),
        ("NVIDIA L4", None),
    ],
)
def test_bandwidth_by_device_kind(kind, bandwidth):
    assert device_check.hbm_bandwidth(kind) == bandwidth


def test_a_prompt_pass_the_device_cannot_hold_is_reported_not_run(monkeypatch):
    """What a CPU never reaches: the table's bandwidth on a known GPU, and a prompt pass
    whose XLA memory analysis exceeds the device's memory (here 1 MiB), not run."""
    ck = device_check.Check(device_check.SMOKE, smoke=True)
    gpu = SimpleNamespace(device_kind="NVIDIA H200", memory_stats=lambda: {"bytes_limit": 2**20})
    monkeypatch.setattr(ck, "device", gpu)
    monkeypatch.setattr(ck, "backend", "gpu")
    assert ck.floor_bandwidth() == (4.8e12, "NVIDIA H200 HBM")
    row = device_check.run_section(ck, 4, "prefill", 600.0)
    assert row.status == "n/a", row.markdown()
    assert "not run: needs" in row.parts[-1] and "MiB > 1 MiB on the device" in row.parts[-1]
