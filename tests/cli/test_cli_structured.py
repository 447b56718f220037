"""`logitloop generate` with constraints per JSONL line and as flags, end to end (slow: a
subprocess that loads and compiles the shipped model)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from .test_cli import read_jsonl, run_cli

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.slow
def test_constrained_lines_and_flags(model_args, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        json.dumps({"id": "c", "prompt": "Label:", "choice": ["spam", "ham"]})
        + "\n"
        + json.dumps({"id": "r", "prompt": "Date:", "regex": "[0-9]{4}-[0-9]{2}"})
        + "\n"
        + json.dumps({"id": "s", "prompt": "JSON:"})
        + "\n",
        encoding="utf-8",
    )
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        "generate",
        "--input",
        str(jobs),
        "--output",
        str(out),
        "--json-schema",
        str(schema),
        "--temperature",
        "1",
        "--max-tokens",
        "32",
        *model_args,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert all(r["finish_reason"] == "stop" for r in rows.values())
    assert rows["c"]["text"] in ("spam", "ham")
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", rows["r"]["text"])
    jsonschema.validate(json.loads(rows["s"]["text"]), SCHEMA)


def test_a_bad_regex_names_its_line_and_construct(model_args, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "a", "regex": "[0-9]+"}\n\n{"prompt": "b", "regex": "(x)\\\\1"}\n')
    proc = run_cli("generate", "-i", str(jobs), "--max-tokens", "2", *model_args)
    assert proc.returncode == 2, proc.stderr
    assert f"{jobs} line 3: regex is not a supported regex: a backreference (\\1)" in proc.stderr
