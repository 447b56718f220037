"""`logitloop explain`: the table and the figure from `python -m logitloop` in a subprocess,
and bad knob values failing exactly as they do for `generate`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from logitloop import cli

# The checkpoint: the `model_args` fixture in conftest.py.

TIMEOUT_S = 300
PROMPT = "Once upon a time"
TOP = 8
TOP_K = 5
DRAWS = 500
STAGES = ("raw", "masks/bias/pen", "temperature", "top-k", "top-p", "min-p=final")
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # the `plot` extra
FATES = {"kept", "cut: masks", "cut: temperature 0", "cut: top-k", "cut: top-p", "cut: min-p"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "logitloop", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def explained(model_args, tmp_path_factory):
    plot = tmp_path_factory.mktemp("explain") / "knobs.png"
    knobs = ["--temperature", "0.7", "--top-k", str(TOP_K), "--top-p", "0.95", "--seed", "3"]
    args = ["explain", PROMPT, *knobs, "--top", str(TOP)]
    if HAVE_MATPLOTLIB:
        args += ["--plot", str(plot), "--draws", str(DRAWS)]
    proc = run_cli(*args, *model_args)
    assert proc.returncode == 0, proc.stderr
    return proc, plot


def _rows(stdout: str) -> tuple[list[str], list[tuple[int, list[float], str]]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    rows = []
    for line in lines[header + 2 :]:
        if not line[:3].strip().isdigit():
            break
        fate = line.rsplit("  ", 1)[-1]
        fields = line[: -len(fate)].split()
        probs = [float(x) for x in fields[-len(STAGES) :]]
        rows.append((int(fields[1]), probs, fate))
    return lines[header], rows


def test_table(explained):
    proc, _ = explained
    assert proc.stdout.startswith("weights: float\n")
    header, rows = _rows(proc.stdout)
    for title in STAGES:
        assert title in header
    assert "kept/cut" in header
    assert len(rows) == TOP  # no masks or bias: the top candidates are the model's own
    for _, probs, fate in rows:
        assert fate in FATES
        assert all(0.0 <= p <= 1.0 for p in probs)
        assert (probs[-1] > 0) == (fate == "kept")
    # top-k keeps exactly the first TOP_K rows (no ties in a float model), and temperature
    # < 1 sharpens: the first row gains probability at every step after the raw one
    fates = [fate for _, _, fate in rows]
    assert all(f != "cut: top-k" for f in fates[:TOP_K])
    assert fates[TOP_K:] == ["cut: top-k"] * (TOP - TOP_K)
    first = rows[0][1]
    assert first == sorted(first)
    kept = sum(probs[-1] for _, probs, _ in rows)
    assert kept == pytest.approx(1.0, abs=1e-3)
    assert re.search(r"with seed 3, ll\.sample draws .* \(id \d+, final probability", proc.stdout)


def test_plot(explained):
    matplotlib_image = pytest.importorskip("matplotlib.image")

    proc, plot = explained
    assert plot.is_file()
    image = matplotlib_image.imread(plot)
    assert image.shape[:2] == (560, 1900)  # 19 x 5.6 inches at 100 dpi
    assert f"wrote {plot} (3 panels; {DRAWS} draws from ll.sample)" in proc.stderr


def test_help_lists_the_flags(capsys):
    assert cli.main(["explain", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--top", "--plot", "--draws", "--model", "--temperature", "--min-p", "--ban"):
        assert flag in out


def _error(capsys, argv: list[str]) -> str:
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("logitloop: error: "), err
    return lines[0]


BAD_KNOBS = {
    "top-p": ["--top-p", "1.5"],
    "temperature": ["--temperature", "-1"],
    "min-p": ["--min-p", "nan"],
    "penalty": ["--repetition-penalty", "0"],
    "presence": ["--presence-penalty", "3"],
    "bias-range": ["--logit-bias", "5=500"],
    "bias-syntax": ["--logit-bias", "5"],
    "top-k-type": ["--top-k", "abc"],
    "min-tokens": ["--min-tokens", "-1"],
    "seed": ["--seed", "-2"],
}


@pytest.mark.parametrize("case", list(BAD_KNOBS))
def test_bad_knob_same_message_as_generate(case, capsys):
    flags = BAD_KNOBS[case]
    generate = _error(capsys, ["generate", PROMPT, *flags])
    explain = _error(capsys, ["explain", PROMPT, *flags])
    # argparse's own messages name the subcommand ("see 'logitloop explain --help'")
    assert explain == generate.replace("logitloop generate", "logitloop explain")


def test_out_of_vocabulary_knob_same_message_as_generate(model_args, capsys):
    flags = ["--ban", str(10**8), *model_args]
    generate = _error(capsys, ["generate", PROMPT, *flags])
    assert "banned_token_ids" in generate and "vocabulary" in generate
    assert _error(capsys, ["explain", PROMPT, *flags]) == generate


def test_bad_knob_exits_2_from_the_command_line():
    proc = run_cli("explain", PROMPT, "--top-p", "1.5")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "logitloop: error: top_p = 1.5 is outside the allowed range (0, 1]"
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--top", "0"], "--top = 0 is outside the allowed range [1, inf)"),
        (["--draws", "0"], "--draws = 0 is outside the allowed range [1, inf)"),
        pytest.param(
            ["--plot", "knobs"],
            "--plot knobs: the file name must end in one of",
            marks=pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib"),
        ),
        pytest.param(
            ["--plot", "/no/such/folder/k.png"],
            "folder not found: /no/such/folder",
            marks=pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib"),
        ),
        (["--model", "/no/such/model"], "checkpoint folder not found: /no/such/model"),
    ],
)
def test_bad_explain_flags(flags, expected, capsys):
    assert expected in _error(capsys, ["explain", PROMPT, *flags])


def test_explain_says_which_weights_are_quantized(capsys):
    # (a float model's "weights: float" line: test_table, -m slow, beside its table)
    pytest.importorskip("qwix", reason="--quantize needs the extra `quant` (qwix)")
    # refused before any tensor is read: the flag reaches load_pretrained
    assert "not divisible by group_size=96" in _error(
        capsys, ["explain", PROMPT, "--quantize", "int4", "--group-size", "96"]
    )


@pytest.mark.slow
def test_quantized_explain_names_the_format(capsys):
    pytest.importorskip("qwix", reason="--quantize needs the extra `quant` (qwix)")
    argv = ["explain", PROMPT, "--quantize", "int4", "--group-size", "32", "--top", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "weights: int4 weights (groups of 32) for 28 attention/MLP projections; embedding, "
        "LM head, norms and biases in float; parameters "
    ), out
