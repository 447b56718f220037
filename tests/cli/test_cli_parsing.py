"""The command line's argument parsing, in process (no model, no compile): what each flag
value becomes, and the one-line error for a bad one."""

from __future__ import annotations

import pytest

from logitloop import cli
from logitloop.jobs.items import read_items

# --stop: (the argument as the shell passes it, the stop string it must become)
STOP_ESCAPES = [
    (r"\n\n", "\n\n"),
    (r"\t", "\t"),
    (r"a\r\nb", "a\r\nb"),
    (r"back\\slash", "back\\slash"),
    (r"\\n", "\\n"),
    (r"quote\"s\'", "quote\"s'"),
    (r"\x41\u00e9\U0001F600", "A\u00e9\U0001f600"),
    (r"\0", "\0"),
    ("plain text", "plain text"),
    ("caf\u00e9 \u2014 ok", "caf\u00e9 \u2014 ok"),
]

# --stop: (the argument, a substring of the one-line error)
STOP_BAD = [
    (r"\q", r"unknown escape \q"),
    ("end\\", "unknown escape \\;"),
    (r"\x4", r"unknown escape \x"),
    (r"\ud800", r"\ud800 is not a Unicode character"),
    (r"\U00110000", r"\U00110000 is not a Unicode character"),
]


def _generate_args(*argv: str):
    return cli.build_parser().parse_args(["generate", "hello", *argv])


@pytest.mark.parametrize("given, expected", STOP_ESCAPES, ids=[g for g, _ in STOP_ESCAPES])
def test_stop_flag_reads_backslash_escapes(given, expected):
    assert _generate_args("--stop", given).stop == [expected]


@pytest.mark.parametrize("given, message", STOP_BAD, ids=[g for g, _ in STOP_BAD])
def test_stop_flag_rejects_unknown_escapes(given, message):
    with pytest.raises(cli.CLIError) as err:
        _generate_args("--stop", given)
    assert "--stop" in str(err.value) and message in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "argv, mode",
    [
        ((), None),  # decided by run_generate: on with --output, off otherwise
        (("--deterministic",), True),
        (("--no-deterministic",), False),
        (("--deterministic-model-parallel",), "model-parallel"),
    ],
)
def test_deterministic_flags_give_the_mode(argv, mode):
    got = _generate_args(*argv).deterministic
    assert got == mode and type(got) is type(mode)


@pytest.mark.parametrize(
    "argv, mode",
    [
        ((), False),
        (("--output", "{out}"), True),
        (("--output", "{out}", "--no-deterministic"), False),
        (("--output", "{out}", "--deterministic-model-parallel"), "model-parallel"),
    ],
)
def test_a_resumable_job_is_deterministic_by_default(argv, mode, tmp_path, monkeypatch):
    # Only the deterministic mode makes a prompt's output independent of its batch, so that
    # a job resumed in other batches writes what an uninterrupted one would (issue 47).
    from logitloop.cli import run_generate

    seen = []
    monkeypatch.setattr(run_generate, "_run_job", lambda args, *rest: seen.append(args) or 0)
    args = _generate_args(*[a.format(out=tmp_path / "out.jsonl") for a in argv], "-q")
    assert run_generate.run(args) == 0
    assert seen[0].deterministic == mode and type(seen[0].deterministic) is type(mode)


def test_stop_flag_help_names_the_escapes():
    text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--stop '\\n\\n'" in text, text


# Messages, in process: (arguments, files to write first, the exact error line). Every case
# fails before the model is loaded, except the last two, which load a model without a
# tokenizer.
MESSAGES = [
    (
        ["--logit-bias", "5=200"],
        {},
        "logit_bias token 5: bias = 200.0 is outside the allowed range [-100, 100]",
    ),
    (
        ["--seed", "4294967296"],
        {},
        "seed = 4294967296 is outside the allowed range [0, 4294967295]",
    ),
    (
        ["--max-tokens", "2147483648"],
        {},
        "max_tokens = 2147483648 is outside the allowed range [1, 2147483647]",
    ),
    (
        ["--repetition-guard", "40,3"],
        {},
        "repetition_guard max_period = 40 is outside the allowed range [1, 32]",
    ),
    (
        ["--input", "{tmp}/g.jsonl"],
        {"g.jsonl": '{"prompt": "a", "repetition_guard": [4, 1]}\n'},
        "{tmp}/g.jsonl line 1: repetition_guard min_repeats = 1 is outside the allowed range "
        "[2, 65536]",
    ),
    (
        ["--input", "{tmp}/b.jsonl"],
        {"b.jsonl": '{"prompt": "a"}\n{"prompt": "b", "logit_bias": {"7": 500}}\n'},
        "{tmp}/b.jsonl line 2: logit_bias token 7: bias = 500 is outside the allowed range "
        "[-100, 100]",
    ),
    (  # nested past the parser's depth: a RecursionError traceback before
        ["--input", "{tmp}/deep.jsonl"],
        {"deep.jsonl": '{"prompt": "a"}\n' + "[" * 100_000 + "\n"},
        "{tmp}/deep.jsonl line 2: JSON nested too deep to read",
    ),
    # Prompts: the library's own check (logitloop.decoding.engine.host), named by the line.
    (
        ["--input", "{tmp}/p.jsonl"],
        {"p.jsonl": '{"prompt_token_ids": [1, 2.5]}\n'},
        "{tmp}/p.jsonl line 1: prompt_token_ids holds 2.5, which is not a token id (an int)",
    ),
    (
        ["--input", "{tmp}/p.jsonl"],
        {"p.jsonl": '{"prompt": "a"}\n{"prompt_token_ids": []}\n'},
        "{tmp}/p.jsonl line 2: prompt_token_ids is empty: a prompt needs at least one token",
    ),
    (
        ["--input", "{tmp}/p.jsonl"],
        {"p.jsonl": '{"id": "q", "prompt_token_ids": "12"}\n'},
        '{tmp}/p.jsonl line 1 (id "q"): prompt_token_ids must be a list, got str',
    ),
    (
        ["--input", "{tmp}/s.jsonl", "--model", "{tmp}/no-tokenizer"],
        {"s.jsonl": '{"prompt_token_ids": [1, 2], "stop": ["x"]}\n'},
        "{tmp}/s.jsonl line 1: stop strings need a model that carries a tokenizer",
    ),
    (
        ["--input", "{tmp}/s.jsonl", "--model", "{tmp}/no-tokenizer"],
        {"s.jsonl": '{"prompt_token_ids": [1, 2]}\n{"prompt": "hi"}\n'},
        "{tmp}/s.jsonl line 2: the prompt is a string but the model has no tokenizer",
    ),
]


def _no_tokenizer_model(folder):
    import shutil
    from pathlib import Path

    import logitloop

    shipped = Path(logitloop.__file__).parent / "models" / "tiny"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(shipped / name, folder / name)


@pytest.mark.parametrize(
    "argv, files, expected", MESSAGES, ids=[f"message-{i}" for i in range(len(MESSAGES))]
)
def test_error_messages_read_right(argv, files, expected, tmp_path, capsys):
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    if "{tmp}/no-tokenizer" in argv:
        _no_tokenizer_model(tmp_path / "no-tokenizer")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    status = cli.main(["generate", *([] if "--input" in argv else ["a"]), *argv, "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == ["logitloop: error: " + expected.replace("{tmp}", str(tmp_path))]


def test_a_bom_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffHello\nWorld\n".encode())
    items = read_items(str(path), {}, [])
    assert [it.prompt for it in items] == ["Hello", "World"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_bytes('\ufeff{"prompt": "Hi"}\n'.encode())
    assert [it.prompt for it in read_items(str(jsonl), {}, [])] == ["Hi"]


@pytest.mark.parametrize("command", ["generate", "explain", "chat"])
def test_help_lines_are_wrapped(command):
    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    long = [line for line in parser.format_help().splitlines() if len(line) > 100]
    assert long == [], long


def test_the_command_line_ends_its_process_with_every_line_delivered():
    """`python -m logitloop` ends the process itself, skipping the interpreter's teardown:
    text still buffered for a pipe (argparse's help is not flushed) must arrive, and the
    exit status must be the command's."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a real buffer
    env["JAX_PLATFORMS"] = "cpu"
    run = lambda *argv: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "logitloop", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shown = run("generate", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--batch-size" in shown.stdout
    assert shown.stdout.rstrip().endswith("compiles afresh every run.")
    bad = run("generate", "x", "--top-p", "2")
    assert bad.returncode == 2
    assert bad.stderr == "logitloop: error: top_p = 2.0 is outside the allowed range (0, 1]\n"


def test_repetition_guard_flag():
    from logitloop.cli.common import CLIError
    from logitloop.cli.parser import base_knobs
    from logitloop.jobs.items import row_params

    params = row_params(base_knobs(_generate_args("--repetition-guard", "8,3")))
    assert (int(params.guard_period[0]), int(params.guard_repeats[0])) == (8, 3)
    assert int(row_params(base_knobs(_generate_args())).guard_period[0]) == 0  # off
    with pytest.raises(CLIError, match="--repetition-guard: expected MAX_PERIOD,MIN_REPEATS"):
        _generate_args("--repetition-guard", "8")


def test_constraint_flags_and_jsonl_keys(tmp_path):
    """--json-schema FILE, --regex, --choice, and the same keys per JSONL line (a line's
    constraint replaces the flags')."""
    from logitloop.cli.parser import base_knobs
    from logitloop.jobs.items import param_defaults, row_params

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "boolean"}', encoding="utf-8")
    knobs = base_knobs(_generate_args("--json-schema", str(schema)))
    assert row_params(knobs).constraints[0].regex == "(true|false)"
    knobs = base_knobs(_generate_args("--choice", "yes", "--choice", "no"))
    assert row_params(knobs).constraints[0].source == '["yes", "no"]'
    assert row_params(base_knobs(_generate_args("--regex", "[0-9]+"))).constraints[0].kind == (
        "regex"
    )
    lines = tmp_path / "p.jsonl"
    lines.write_text(
        '{"prompt": "a", "choice": ["x", "y"]}\n{"prompt": "b"}\n'
        '{"prompt": "c", "json_schema": {"type": "integer", "minimum": 1, "maximum": 3}}\n',
        encoding="utf-8",
    )
    items = read_items(str(lines), {"regex": "z+"}, param_defaults())
    kinds = [row_params(item.knobs).constraints[0].kind for item in items]
    assert kinds == ["choice", "regex", "json_schema"]
    with pytest.raises(cli.common.CLIError, match=r"regex(\[0\])? is not a supported regex"):
        row_params({"regex": "(a"})
