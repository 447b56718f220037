"""Offline lm-eval tasks the tests write (task YAMLs over local JSONL, `dataset_path:
json`), a random small Llama written with transformers, and a runner that returns each
sample's responses next to the aggregate metrics."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import logitloop

MC_DOCS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " London", " a dog"],
        "answer": 0,
    },
    {
        "question": "Two plus two equals",
        "choices": [" four", " five", " seven", " many"],
        "answer": 0,
    },
    {
        "question": "Once upon a time, there was a",
        "choices": [" girl", " boy", " cat"],
        "answer": 2,
    },
    {"question": "The sky is ", "choices": ["blue", "green"], "answer": 0},
    {"question": "", "choices": ["Hello", "World"], "answer": 1},
]
TEXT_DOCS = [
    {"text": "Once upon a time, there was a little girl named Lily. She liked to play."},
    {"text": "The cat sat on the mat. " * 12},
    {"text": "Tom had a red ball."},
]
GEN_DOCS = [
    {"question": "Once upon a time,", "answer": " there was"},
    {"question": "Lily and Tom went to the", "answer": " park"},
    {"question": "The dog", "answer": " was"},
    {"question": "One day, a little boy named", "answer": " Tim"},
]

TASKS = {
    "ll_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "ll_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "ll_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}
DATA = {"ll_mc": MC_DOCS, "ll_rolling": TEXT_DOCS, "ll_gen": GEN_DOCS}


def write_tasks(folder: Path) -> Path:
    """One YAML and one JSONL per task in `folder` (pass it as `include_path`)."""
    for name, body in TASKS.items():
        write_task(folder, name, body, DATA[name])
    return folder


def write_task(folder: Path, name: str, body: str, docs: list[dict]) -> Path:
    """Task `name` (a YAML `body` of `TASKS`' kind over `docs`) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    header = (
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    )
    (folder / f"{name}.yaml").write_text(header + body)
    return folder


BOS_TEXT, BOS_ID = "<|im_start|>", 4096  # the shipped tokenizer's token the BOS variant adds


def random_llama(folder: Path, max_positions: int = 48, seed: int = 0, bos: bool = False) -> Path:
    """A random float32 Llama written by transformers, with the shipped model's tokenizer
    (4098 tokens) and a short context, so that the rolling documents span windows. `bos`:
    its tokenizer puts BOS (`<|im_start|>`) before every text, as Llama's does (lm-eval's
    empty context is then BOS, and a rolling document's first window predicts after it)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=4098, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=max_positions, bos_token_id=BOS_ID if bos else None, eos_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # far from ties, so greedy picks are stable across backends
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(10.0)
    model.save_pretrained(folder, safe_serialization=True)
    shipped = Path(logitloop.__file__).parent / "models" / "tiny"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(shipped / name, folder / name)
    if bos:
        tok = json.loads((folder / "tokenizer.json").read_text())
        special = {"SpecialToken": {"id": BOS_TEXT, "type_id": 0}}
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS_TEXT: {"id": BOS_TEXT, "ids": [BOS_ID], "tokens": [BOS_TEXT]}},
        }  # fmt: skip
        (folder / "tokenizer.json").write_text(json.dumps(tok))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["bos_token"] = BOS_TEXT
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def evaluate(
    model: Any, model_args: str | None, task_dir: Any, tasks: list[str], **kw: Any
) -> dict:
    """`simple_evaluate` offline (`model` a name, or an `LM` instance without model_args):
    {"results": aggregate metrics per task, "samples": per task, the responses of each
    doc in doc order, "arguments": the requests' arguments (context, ...) likewise}.
    `task_dir`: the tasks' folder, or a `TaskManager` over it (building one indexes
    lm-eval's whole task library, seconds: reuse one across calls)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = task_dir if isinstance(task_dir, TaskManager) else None
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks,
        task_manager=manager or TaskManager(include_path=str(task_dir)), log_samples=True,
        verbosity="ERROR", **kw,
    )  # fmt: skip
    samples = {
        task: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
        for task, rows in out["samples"].items()
    }
    arguments = {
        task: [s["arguments"] for s in sorted(rows, key=lambda s: s["doc_id"])]
        for task, rows in out["samples"].items()
    }
    results = {
        task: {k: v for k, v in r.items() if k != "alias"} for task, r in out["results"].items()
    }
    return {"results": results, "samples": samples, "arguments": arguments}
