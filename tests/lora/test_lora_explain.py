"""`explain_next_token(..., adapters=, adapter=)` and `logitloop explain --adapter NAME=PATH
--use-adapter NAME` (issue 71): the prompt's prefill runs under the row's adapter, so the
explained logits are transformers' on the PEFT-merged model and `generate`'s first step
under the same adapter (not the base's); bad adapters are refused by name before the model
runs or loads."""

from __future__ import annotations

import numpy as np
import pytest

import logitloop as ll
from logitloop.cli import main
from logitloop.cli.explain_view import format_table
from logitloop.decoding.engine.explain import explain_next_token
from tests.models.tiny_checkpoints import random_prompts

from .peft_adapters import shipped_model_adapter

ATOL = 1e-4  # the float32 parity tests' tolerance (tests/models/test_model_parity.py)


def test_explain_under_an_adapter_equals_peft_merged_and_generate(setup):
    torch = pytest.importorskip("torch")
    model, table = setup["model"], setup["table"]
    prompt = random_prompts(160, [6], 3)[0]
    params = ll.SamplingParams.create(temperature=0, seed=0)
    names = ["a", None]
    expls = [explain_next_token(model, prompt, params, adapters=table, adapter=n) for n in names]
    out = ll.generate(
        model, [prompt] * 2, adapters=table, adapter=names, temperature=0, max_new_tokens=1,
        ignore_eos=True,
    )  # fmt: skip
    for row, (name, expl) in enumerate(zip(names, expls, strict=True)):
        with torch.no_grad():
            want = setup["merged"][name](torch.tensor([prompt])).logits[0, -1]
        want = want.double().log_softmax(-1).numpy()
        got = np.log(expl.raw.astype(np.float64))
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=str(name))
        token = out.token_ids[row][0]
        assert expl.sampled_token == token == int(np.argmax(want)), name
        np.testing.assert_allclose(got[token], out.raw_logprobs[row][0], rtol=0, atol=1e-5)
    assert np.max(np.abs(expls[0].logits - expls[1].logits)) > 0.1  # the adapter acts


def test_explain_refuses_bad_adapters_by_name(setup):
    model, table = setup["model"], setup["table"]
    params = ll.SamplingParams.create()
    with pytest.raises(ValueError, match=r"adapter\[0\]: unknown adapter 'zz'"):
        explain_next_token(model, [5, 6], params, adapters=table, adapter="zz")
    with pytest.raises(ValueError, match="pass adapters="):
        explain_next_token(model, [5, 6], params, adapter="a")
    with pytest.raises(ValueError, match="adapters must be an ll.Adapters"):
        explain_next_token(model, [5, 6], params, adapters={"a": 1})


def test_cli_explain_runs_under_the_adapter(tmp_path, capsys):
    folder = shipped_model_adapter(tmp_path / "up8", seed=0)
    prompt, flags = "The for statement", ["--seed", "3", "--top", "5"]
    status = main(["explain", prompt, *flags, "--adapter", f"up8={folder}", "--use-adapter", "up8"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    model = ll.load_pretrained()
    table = ll.load_adapter(model, folder, name="up8")
    params = ll.SamplingParams.create(seed=3)
    tables = [
        format_table(explain_next_token(model, prompt, params, adapters=table, adapter=n), 5)
        for n in ("up8", None)
    ]
    assert captured.out.split("\n", 1)[1] == tables[0] + "\n"
    assert tables[0] != tables[1]


def test_cli_explain_adapter_flags_are_checked_before_the_model_loads(capsys):
    argv = ["explain", "Hi", "--adapter", "a=x", "--use-adapter", "b"]
    assert main(argv) == 2
    assert "no --adapter b=PATH loads it" in capsys.readouterr().err
