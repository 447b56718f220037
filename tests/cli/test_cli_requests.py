"""A JSONL line's request settings (`logitloop.jobs.request_keys`): its classifier-free
guidance ("guidance_scale", "negative_prompt") and steering vectors ("steer"), end to end
in process on the shipped model against `ll.generate` of the same prompts and settings,
and bad lines refused by line and key."""

from __future__ import annotations

import json

import numpy as np
import pytest

import logitloop as ll
from logitloop.cli import main
from logitloop.jobs.items import Item, request_error

PROMPT = "The for statement"
FLAGS = ["--max-tokens", "4", "--temperature", "0", "--no-compile-cache", "-q"]
# A vector of the shipped model's hidden size (256), JSON numbers.
VECTOR = [round(float(x), 4) for x in np.random.default_rng(0).standard_normal(256)]


def _write(path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_guided_steered_and_plain_lines_equal_generate(tmp_path, capsys):
    """One job (greedy, 4 tokens): a plain line, a guided one (text negative prompt), a
    steered one (ll.Steer's fields, on its generated tokens) and one both guided (token-id
    negative prompt) and steered (a single object, on every token); each line's tokens are
    `ll.generate`'s under its settings."""
    steer_generated = {"layer": 1, "vector": VECTOR, "scale": 4.0, "tokens": "generated"}
    steer_both = {"layer": 2, "vector": VECTOR[::-1], "scale": -3}
    lines = [
        {"id": "plain", "prompt": PROMPT},
        {"id": "guided", "prompt": PROMPT, "guidance_scale": 3.0, "negative_prompt": "A dog"},
        {"id": "steered", "prompt": PROMPT, "steer": [steer_generated]},
        {"id": "both", "prompt": PROMPT, "guidance_scale": 2, "negative_prompt": [5, 6, 7],
         "steer": steer_both},
    ]  # fmt: skip
    out = tmp_path / "out.jsonl"
    status = main(["generate", "-i", _write(tmp_path / "in.jsonl", lines), "-o", str(out), *FLAGS])
    assert status == 0, capsys.readouterr().err
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}

    def steer(entry):
        return ll.Steer(np.asarray(entry["vector"], np.float32), **{
            k: v for k, v in entry.items() if k != "vector"
        })  # fmt: skip

    want = ll.generate(
        ll.load_pretrained(), [PROMPT] * 4, max_tokens=4, temperature=0, deterministic=True,
        guidance_scale=[None, 3.0, None, 2.0], negative_prompt=[None, "A dog", None, [5, 6, 7]],
        steer=[None, None, steer(steer_generated), steer(steer_both)],
    ).token_ids  # fmt: skip
    assert [got[line["id"]] for line in lines] == want
    assert len({tuple(t) for t in want}) == 4  # each setting changes the tokens


BAD_LINES = {
    "infinite-scale": ('"guidance_scale": Infinity', "guidance_scale = inf is not finite"),
    "string-scale": ('"guidance_scale": "2"', "guidance_scale must be a finite number"),
    "negative-alone": ('"negative_prompt": "x"', "negative_prompt= is given without guidance_"),
    "where": (
        '"steer": {"layer": 0, "vector": [1.0], "where": "prompt"}',
        "steer has unknown key 'where'; an ll.Steer's fields are vector, layer, scale, tokens",
    ),
    "tokens": (
        '"steer": [{"layer": 0, "vector": [1.0], "tokens": "after"}]',
        "steer.tokens must be one of ('both', 'prompt', 'generated'), got 'after'",
    ),
    "string-vector": ('"steer": {"layer": 0, "vector": "1,2"}', "steer.vector must be a list"),
    "nan-scale": (
        '"steer": {"layer": 0, "vector": [1.0], "scale": NaN}',
        "steer.scale must be a finite float",
    ),
    "negative-layer": (
        '"steer": {"layer": -1, "vector": [1.0]}',
        "steer.layer = -1 is out of range: a decoder layer is 0 or more",
    ),
    # Checked once the model is loaded (nothing compiles): its width and its layers.
    "width": (
        '"steer": {"layer": 0, "vector": [1.0, 2.0]}',
        "steer.vector must have shape [256] (the model's hidden size), got (2,)",
    ),
    "layer": (
        f'"steer": [{{"layer": 0, "vector": {VECTOR}}}, {{"layer": 9, "vector": {VECTOR}}}]',
        "steer[1].layer = 9 is out of range: the model's layers are [0, 4)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_request_settings_name_the_line_and_key(case, tmp_path, capsys):
    setting, message = BAD_LINES[case]
    path = tmp_path / "in.jsonl"
    path.write_text(f'{{"prompt": "a"}}\n{{"id": "q", "prompt": "b", {setting}}}\n')
    assert main(["generate", "-i", str(path), *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f'logitloop: error: {path} line 2 (id "q"): ') and message in err[0]


def test_beam_search_refuses_a_guided_line(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", [{"prompt": "a", "guidance_scale": 2.0}])
    assert main(["generate", "-i", path, "--num-beams", "2", "--max-tokens", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl line 1: guidance_scale does not run with --num-beams" in err


def test_a_library_error_about_one_request_names_its_line(tmp_path, capsys):
    """`generate_many`'s error about requests[0] (a guided request under one slot, read
    before anything compiles) names the line it came from."""
    lines = [{"id": "g", "prompt": "c", "guidance_scale": 2}, {"prompt": "a"}]
    path = _write(tmp_path / "in.jsonl", lines)
    assert main(["generate", "-i", path, "--batch-size", "1", *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f'logitloop: error: {path} line 1 (id "g"): a guided request'), err
    items = [Item(i, f"x.jsonl line {i + 1}", "p", {}, i, i + 1) for i in range(3)]
    assert str(request_error(items, ValueError("requests[2]: bad"))) == "x.jsonl line 3: bad"
    assert str(request_error(items, ValueError("bad"))) == "x.jsonl lines 1 to 3: bad"
