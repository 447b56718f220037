"""The command line's argument parsing, in process (no model, no compile): what each flag
value becomes, and the one-line error for a bad one."""

from __future__ import annotations

import pytest

from logitloop import cli

# --stop: (the argument as the shell passes it, the stop string it must become)
STOP_ESCAPES = [
    (r"\n\n", "\n\n"),
    (r"\t", "\t"),
    (r"a\r\nb", "a\r\nb"),
    (r"back\\slash", "back\\slash"),
    (r"\\n", "\\n"),
    (r"quote\"s\'", "quote\"s'"),
    (r"\x41\u00e9\U0001F600", "A\u00e9\U0001F600"),
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


def test_stop_flag_help_names_the_escapes():
    text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--stop '\\n\\n'" in text, text
