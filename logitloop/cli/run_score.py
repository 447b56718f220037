"""`logitloop score`: the log-likelihood of given continuations (`ll.score`), JSONL in and
JSONL out, resumed like `generate`'s output.

Each input line is an object with an optional `"id"` (default: the 0-based line number),
`"prompt"` (a string) or `"prompt_token_ids"`, `"continuation"` (a string, tokenized in
the prompt's context as lm-evaluation-harness does) or `"continuation_token_ids"`, and
optionally `"adapter"`: a LoRA adapter `--adapter NAME=PATH` loaded (null: the base model;
absent: `--use-adapter`'s, else the base). Each output line, in input order:

    {"id", "token_ids", "raw_logprobs", "sum", "is_greedy", "is_argmax"}

plus `"text"` (the continuation's tokens decoded, with a tokenizer), `"top_logprobs"`
(per token, `[token_id, logprob]` pairs) with `--top-logprobs N`, and `"error"` where the
model's logits went NaN or inf (`ScoreResult.error`). The pairs run in chunks
of a few batches; each chunk's lines are written (and fsync'ed) as it ends, so a killed
job resumes where it stopped.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from logitloop.cli.common import PROG, CLIError, adapter_specs, resolve_models
from logitloop.jobs import load_adapters, load_model
from logitloop.jobs.items import _read_text, json_line
from logitloop.jobs.sinks import JsonlOutput, check_not_input, describe_id, id_key

PROMPT_KEYS = ("prompt", "prompt_token_ids")
CONTINUATION_KEYS = ("continuation", "continuation_token_ids")
BATCHES_PER_WRITE = 4


def read_pairs(path: str) -> list[dict[str, Any]]:
    """The input's lines as {"id", "where", "prompt", "continuation"}; bad lines are a
    CLIError naming the line."""
    text = _read_text(path)
    name = "stdin" if path == "-" else path
    pairs, seen = [], {}
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        obj, item_id, where = json_line(line, f"{name} line {i + 1}", i)
        pair = {"id": item_id, "where": where}
        for role, keys in (("prompt", PROMPT_KEYS), ("continuation", CONTINUATION_KEYS)):
            given = [k for k in keys if k in obj]
            if len(given) != 1:
                raise CLIError(f"{where}: give exactly one of {keys[0]!r} and {keys[1]!r}")
            value = obj[given[0]]
            want = str if given[0] == keys[0] else list
            if not isinstance(value, want):
                kind = "a string" if want is str else "a list of token ids"
                raise CLIError(f"{where}: {given[0]} must be {kind}")
            pair[role] = value
        unknown = set(obj) - {"id", *PROMPT_KEYS, *CONTINUATION_KEYS, "adapter"}
        if unknown:
            raise CLIError(
                f"{where}: unknown key {sorted(unknown)[0]!r}; a line holds id, prompt or "
                "prompt_token_ids, continuation or continuation_token_ids, and adapter"
            )
        if "adapter" in obj:
            if obj["adapter"] is not None and not isinstance(obj["adapter"], str):
                raise CLIError(f"{where}: adapter must be an adapter's name or null")
            pair["adapter"] = obj["adapter"]
        key = id_key(item_id)
        if key in seen:
            raise CLIError(f"duplicate id {describe_id(item_id)} in {name}: {seen[key]}, {where}")
        seen[key] = where
        pairs.append(pair)
    if not pairs:
        raise CLIError(f"{name} holds no pairs")
    return pairs


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def score_record(pair: dict[str, Any], result) -> dict[str, Any]:
    rec = {
        "id": pair["id"],
        "token_ids": result.token_ids,
        "raw_logprobs": [_finite(x) for x in result.raw_logprobs],
        "sum": _finite(result.raw_logprob_sum),
        "is_greedy": result.is_greedy,
        "is_argmax": result.is_argmax,
    }
    if result.text is not None:
        rec["text"] = result.text
    if pair.get("adapter") is not None:
        rec["adapter"] = pair["adapter"]
    if result.error is not None:  # logits gone NaN or inf (`ScoreResult.error`)
        rec["error"] = result.error
    if result.top_logprobs is not None:
        rec["top_logprobs"] = [
            [[int(t), _finite(v)] for t, v in sorted(d.items(), key=lambda kv: -kv[1])]
            for d in result.top_logprobs
        ]
    return rec


def run(args: argparse.Namespace) -> int:
    """The `score` subcommand; returns the exit status."""
    import logitloop as ll

    started = time.perf_counter()
    if args.batch_size < 1:
        raise CLIError(f"--batch-size = {args.batch_size} is outside the allowed range [1, inf)")
    if not 0 <= args.top_logprobs <= 20:
        raise CLIError(f"--top-logprobs = {args.top_logprobs} is outside the allowed range [0, 20]")
    if args.overwrite and not args.output:
        raise CLIError("--overwrite needs --output FILE")
    if args.deterministic is None:
        # As `generate --output`: a job written to --output can be resumed, in other
        # batches, and only the deterministic mode makes a pair's scores independent of
        # its batch (docs/cli.md).
        args.deterministic = bool(args.output)
    resolve_models(args)
    specs = adapter_specs(args)
    pairs = read_pairs(args.input)
    for pair in pairs:  # a line's adapter, else --use-adapter's; loaded by --adapter
        pair.setdefault("adapter", args.use_adapter)
        if pair["adapter"] is not None and pair["adapter"] not in specs:
            raise CLIError(
                f"{pair['where']}: adapter {pair['adapter']!r} is not one of the job's "
                f"adapters (loaded: {', '.join(specs) or 'none'}; --adapter NAME=PATH loads one)"
            )
    output = args.output or "-"
    check_not_input(output, args.input)

    def warn(message: str) -> None:
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)

    sink = JsonlOutput.open(output, args.overwrite, warn)
    try:
        todo = [p for p in pairs if id_key(p["id"]) not in sink.done]
        if not todo:
            if not args.quiet:
                done = f"all {len(pairs)} pairs are already in {sink.name}"
                print(f"{PROG}: nothing to do: {done}", file=sys.stderr)
            return 0
        model = load_model(
            args.model, args.dtype, args.quantize, args.group_size, args.quantize_embedding
        )
        table = load_adapters(model, specs)  # None without --adapter
        chunk = args.batch_size * BATCHES_PER_WRITE
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            rows = {} if table is None else {"adapter": [p["adapter"] for p in part]}
            try:
                results = ll.score(
                    model, [p["prompt"] for p in part], [p["continuation"] for p in part],
                    deterministic=args.deterministic, top_logprobs=args.top_logprobs,
                    batch_size=args.batch_size, adapters=table, **rows,
                )  # fmt: skip
            except ValueError as e:
                raise CLIError(_name_row(str(e), part)) from None
            sink.write([score_record(p, r) for p, r in zip(part, results, strict=True)], 1)
            if not args.quiet:
                print(f"{PROG}: {start + len(part)}/{len(todo)} pairs scored", file=sys.stderr)
        if not args.quiet:
            skipped = len(pairs) - len(todo)
            skip = f" ({skipped} already in {sink.name}, skipped)" if skipped else ""
            print(
                f"{PROG}: {len(todo)} pairs scored{skip} in {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
            )
        return 0
    finally:
        sink.close()


def _name_row(message: str, part: list[dict[str, Any]]) -> str:
    """The library names a pair `prompts[i]` / `continuations[i]` in its chunk: name the line."""
    for key in ("prompts[", "continuations["):
        if message.startswith(key):
            index = int(message[len(key) : message.index("]")])
            return f"{part[index]['where']}: {message}"
    return message
