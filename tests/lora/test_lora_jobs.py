"""LoRA adapters in the job entry points (issue 71): `logitloop generate --adapter
NAME=PATH` with a JSONL line's "adapter", Ray jobs' actors (`ll_ray.Generator`, run here
in process), and the lm-eval backend's `adapter=` against lm-eval's `hf` with `peft=`.
Each row equals transformers with its adapter merged (PEFT's `merge_and_unload`)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from logitloop.cli import main  # noqa: E402
from tests.models.tiny_checkpoints import random_prompts  # noqa: E402

from .peft_adapters import make_adapter, torch_greedy  # noqa: E402

TOKENS = 4
NAMES = ["a", None, "b"]  # the lines' adapters ("adapter": null is the base model)
# The CLI's job and the Ray actor's share their shapes: 2 slots, bounds from the lines.
FLAGS = ["--max-tokens", str(TOKENS), "--temperature", "0", "--ignore-eos", "--batch-size", "2"]


def _lines(tmp_path, prompts):
    path = tmp_path / "in.jsonl"
    lines = [
        {"id": f"q{i}", "prompt_token_ids": p, "adapter": name}
        for i, (p, name) in enumerate(zip(prompts, NAMES, strict=True))
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path, lines


def _adapter_flags(setup):
    return ["--adapter", f"a={setup['dir'] / 'a'}", "--adapter", f"b={setup['dir'] / 'b'}"]


def test_cli_jsonl_lines_run_their_adapters(setup, tmp_path):
    prompts = random_prompts(160, [6, 8, 5], 21)
    path, _ = _lines(tmp_path, prompts)
    out = tmp_path / "out.jsonl"
    status = main([
        "generate", "--model", str(setup["dir"] / "base"), "--input", str(path), "--output",
        str(out), "-q", "--no-deterministic", *FLAGS, *_adapter_flags(setup),
    ])  # fmt: skip
    assert status == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record, prompt, name in zip(records, prompts, NAMES, strict=True):
        assert record["token_ids"] == torch_greedy(setup["merged"][name], prompt, TOKENS)[0]
        assert record.get("adapter") == name


def test_cli_adapter_flags_are_checked_before_the_model_loads(setup, tmp_path, capsys):
    path, _ = _lines(tmp_path, random_prompts(160, [3, 3, 3], 22))
    base = ["generate", "--model", str(setup["dir"] / "base"), "--input", str(path), *FLAGS]
    cases = [
        (["--adapter", f"a={setup['dir'] / 'a'}"], "line 3 (id \"q2\"): adapter 'b' is not one"),
        (_adapter_flags(setup) + ["--use-adapter", "c"], "no --adapter c=PATH loads it"),
        (["--adapter", "a=x", "--adapter", "a=y"], "the name 'a' is given twice"),
    ]
    for flags, message in cases:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "x", "--adapter", "no-equals-sign"]) == 2
    assert "'no-equals-sign' is not NAME=PATH" in capsys.readouterr().err


def test_cli_score_lines_run_their_adapters(setup, tmp_path):
    """`logitloop score --adapter`: each line's continuation scored under its adapter, as
    the merged model scores it (the float32 parity tolerance)."""
    import numpy as np
    import torch

    prompts = random_prompts(160, [5, 7, 4], 24)
    conts = random_prompts(160, [3, 2, 4], 25)
    path = tmp_path / "pairs.jsonl"
    lines = [
        {"prompt_token_ids": p, "continuation_token_ids": c, "adapter": name}
        for p, c, name in zip(prompts, conts, NAMES, strict=True)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "scores.jsonl"
    status = main([
        "score", "--model", str(setup["dir"] / "base"), "--input", str(path), "--output",
        str(out), "-q", "--no-deterministic", *_adapter_flags(setup),
    ])  # fmt: skip
    assert status == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record, prompt, cont, name in zip(records, prompts, conts, NAMES, strict=True):
        with torch.no_grad():
            logits = setup["merged"][name](torch.tensor([prompt + cont])).logits[0]
        lp = logits.double().log_softmax(-1)
        want = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(cont)]
        np.testing.assert_allclose(record["raw_logprobs"], want, rtol=0, atol=1e-4)
        assert record.get("adapter") == name


def test_ray_actor_rows_run_their_adapters(setup, tmp_path):
    """The actor Ray runs (`Generator`, in process: its code is the job's, not Ray's)
    loads the adapters and gives each row its line's; `item_rows` hands a line's adapter
    to the actors."""
    import numpy as np

    ll_ray = pytest.importorskip("logitloop.integrations.ray")
    from logitloop.jobs.items import read_items

    prompts = random_prompts(160, [6, 8, 5], 23)
    path, lines = _lines(tmp_path, prompts)
    items = read_items(str(path), {"max_tokens": TOKENS}, ["max_tokens"])
    rows = ll_ray.item_rows(items, {"max_tokens": TOKENS})
    assert [json.loads(r[ll_ray.LINE_COLUMN]).get("adapter") for r in rows] == NAMES
    generator = ll_ray.Generator(
        model=str(setup["dir"] / "base"), params={"max_tokens": TOKENS, "temperature": 0},
        ignore_eos=True, deterministic=False, slots=2, compile_cache=False,
        adapters={"a": str(setup["dir"] / "a"), "b": str(setup["dir"] / "b")},
    )  # fmt: skip
    batch = {ll_ray.LINE_COLUMN: np.array([json.dumps(line) for line in lines], dtype=object)}
    for record, prompt, name in zip(generator.records(batch), prompts, NAMES, strict=True):
        assert record["token_ids"] == torch_greedy(setup["merged"][name], prompt, TOKENS)[0]
    unknown = {ll_ray.LINE_COLUMN: np.array([json.dumps({"prompt": "x", "adapter": "zz"})])}
    with pytest.raises(ValueError, match="adapter 'zz' is not one of the job's adapters"):
        generator.records(unknown)


def test_lm_eval_bad_adapter_is_named():
    pytest.importorskip("lm_eval")
    from logitloop.integrations.lm_eval import LogitloopLM

    with pytest.raises(ValueError, match=r"adapter='/nonexistent': .*adapter folder not found"):
        LogitloopLM(adapter="/nonexistent", compile_cache="false")  # the shipped model


@pytest.mark.slow  # three evaluations (two on transformers); the CLI and Ray tests above
def test_lm_eval_adapter_equals_hf_peft(tmp_path):
    """`model_args adapter=PATH` scores every request under the adapter: the same
    per-sample log-likelihoods as lm-eval's `hf` backend with `peft=PATH` (PEFT applying
    the adapter to the transformers model), on the random Llama with the shipped
    tokenizer (tests/integrations). Cheap settings as the default lm-eval test's."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    import transformers

    from tests.integrations.lm_eval_tasks import evaluate, random_llama, write_tasks
    from tests.integrations.test_lm_eval import assert_same_as_hf

    folder = random_llama(tmp_path / "llama")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    make_adapter(base, tmp_path / "adapter", rank=8, alpha=16, seed=3)
    tasks = write_tasks(tmp_path / "tasks")
    args = f"pretrained={folder},dtype=float32"
    ours = evaluate(
        "logitloop", f"{args},deterministic=false,adapter={tmp_path / 'adapter'}", tasks,
        ["ll_mc"], batch_size=16,
    )  # fmt: skip
    ref = evaluate(
        "hf", f"{args},peft={tmp_path / 'adapter'}", tasks, ["ll_mc"], batch_size=16,
        device="cpu",
    )  # fmt: skip
    plain = evaluate("hf", args, tasks, ["ll_mc"], batch_size=16, device="cpu")
    assert plain["samples"] != ref["samples"]  # the adapter changes the scores
    assert_same_as_hf(ours, ref)


def test_an_adapter_by_its_hub_name_loads_what_its_folder_loads(setup, monkeypatch, tmp_path):
    """`load_adapter(model, "org/name")` fetches the adapter's two files (not PEFT's
    README beside them) into the Hugging Face cache, from the fake Hub of tests/models, and
    offline from the cache; a repo of pickled weights only is refused by name."""
    import jax
    import numpy as np

    import logitloop as ll
    from tests.models.fake_hub import offline, serving

    with serving(monkeypatch, tmp_path) as hub:
        commit = hub.add_folder("org/lora-a", setup["dir"] / "a")
        hub.add_commit("org/pickled", {"adapter_config.json": b"{}", "adapter_model.bin": b""})
        table = ll.load_adapter(setup["model"], "org/lora-a", name="a")
        snapshot = hub.cache / "models--org--lora-a" / "snapshots" / commit
        assert sorted(p.name for p in snapshot.iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors",
        ]  # fmt: skip
        with pytest.raises(ValueError, match=r"adapter 'org/pickled' .* only adapter_model.bin"):
            ll.load_adapter(setup["model"], "org/pickled", name="p")
        offline(monkeypatch)
        again = ll.load_adapter(setup["model"], "org/lora-a", name="a")
    want = ll.load_adapter(setup["model"], setup["dir"] / "a", name="a")
    for got in (table, again):
        for x, y in zip(jax.tree.leaves(got.table), jax.tree.leaves(want.table), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
