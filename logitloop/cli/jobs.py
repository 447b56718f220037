"""A `generate` job's prompts: read from arguments or an input file (plain text or JSONL),
each with its sampling settings validated by `SamplingParams.create` once, tokenized and
checked against the model, and turned into one output record when done.

A message about one prompt names it by where it came from ("prompts.jsonl line 4 (id
"q1")", "prompt 1"), followed by the library's own message for that row.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logitloop.cli.common import CLIError, check_prompt_text
from logitloop.cli.sinks import describe_id, id_key


@dataclass
class Item:
    """One prompt of the job."""

    id: Any
    where: str  # names the prompt in messages: "prompts.jsonl line 4" or "prompt 1"
    prompt: str | list[int]
    knobs: dict[str, Any]  # SamplingParams.create's arguments for this prompt
    position: int  # index in the input
    line: int = 0  # 1-based line in the input file (0 for a PROMPT argument)
    token_ids: list[int] | None = None  # set by `prepare_tokens`
    params: Any = None  # SamplingParams of batch 1, set by `validate_params`


# --------------------------------------------------------------------------- sampling settings


def param_defaults() -> dict[str, Any]:
    """SamplingParams.create's keyword arguments and their defaults (the per-line keys)."""
    from logitloop.decoding.params import SamplingParams

    sig = inspect.signature(SamplingParams.create)
    return {
        name: p.default
        for name, p in sig.parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "vocab_size"
    }


_ID_LIST_KNOBS = ("banned_token_ids", "allowed_token_ids", "stop_token_ids")
_CONSTRAINT_KNOBS = ("json_schema", "regex", "choice")  # at most one per prompt


def _normalise_override(name: str, value: Any, where: str) -> Any:
    """One JSONL line's setting, in the per-row form SamplingParams.create takes."""
    if value is None:
        return None
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise CLIError(f"{where}: logit_bias must be an object of token id -> bias")
        out = {}
        for key, bias in value.items():
            try:
                tok = int(key)
            except ValueError:
                raise CLIError(
                    f"{where}: logit_bias has key {key!r}; keys must be integer token ids"
                ) from None
            out[tok] = bias
        return out
    if name in _ID_LIST_KNOBS:
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise CLIError(f"{where}: {name} must be a list of integer token ids, got {value!r}")
        return value
    if name == "stop":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise CLIError(f"{where}: stop must be a string or a list of strings, got {value!r}")
        return value
    if name == "stop_sequences":
        if not isinstance(value, list) or not all(
            isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in s)
            for s in value
        ):
            raise CLIError(
                f"{where}: stop_sequences must be a list of token-id lists, got {value!r}"
            )
        return value
    return value


def _row_value(name: str, value: Any) -> Any:
    """A knob's value for one row, in the shape that makes per-row lists unambiguous."""
    if name in ("banned_token_ids", "stop_token_ids", "stop_sequences", "stop"):
        if value is None:
            return []
        if name == "stop" and isinstance(value, str):
            return [value]
        return list(value)
    if name == "logit_bias":
        return {} if value is None else dict(value)
    return value


# SamplingParams names every value by its row ("top_p[0] = 1.5 ..."); a job's row is named
# by its input line instead, so the index of the batch of one is left out.
_ROW_INDEX = re.compile(r"\b([A-Za-z_]+)\[0\](?!\[)")


def one_row_message(error: Exception | str) -> str:
    """SamplingParams' message for a batch of one, without the `[0]` row index."""
    return _ROW_INDEX.sub(r"\1", str(error))


def row_params(knobs: dict[str, Any], where: str | None = None):
    """`SamplingParams.create` of one row (which validates every setting); a bad setting is a
    CLIError naming `where` (nothing: a flag)."""
    from logitloop.decoding.params import SamplingParams

    kwargs = {
        name: [_row_value(name, value)]
        for name, value in knobs.items()
        if not (name == "allowed_token_ids" and value is None)  # None: every token allowed
    }
    try:
        return SamplingParams.create(1, **kwargs)
    except ValueError as e:
        raise _row_error(where, e) from None


def check_vocab(params, vocab_size: int, where: str | None = None) -> None:
    """The row's token ids against the model's vocabulary (`SamplingParams.check_vocab`)."""
    try:
        params.check_vocab(vocab_size)
    except ValueError as e:
        raise _row_error(where, e) from None


def _row_error(where: str | None, error: Exception) -> CLIError:
    message = one_row_message(error)
    return CLIError(message if where is None else f"{where}: {message}")


def validate_params(items: Sequence[Item], base: dict[str, Any], base_params) -> None:
    """Each prompt's SamplingParams, built once: the flags' own (`base_params`) for a prompt
    that overrides nothing."""
    for item in items:
        item.params = base_params if item.knobs == base else row_params(item.knobs, item.where)


def span(items: Sequence[Item]) -> str:
    """Names a run of prompts in messages: "prompt 3", "prompts 0 to 3", "x.jsonl lines 1
    to 4"."""
    first, last = items[0], items[-1]
    if first is last:
        return first.where
    if first.line and last.line:
        name = first.where.rsplit(" line ", 1)[0]
        return f"{name} lines {first.line} to {last.line}"
    return f"prompts {first.position} to {last.position}"


# --------------------------------------------------------------------------- inputs


def prompt_items(prompts: Sequence[str], base: dict[str, Any]) -> list[Item]:
    """The PROMPT arguments as items (ids 0, 1, ...)."""
    items = [Item(i, f"prompt {i}", p, dict(base), i) for i, p in enumerate(prompts)]
    for item in items:
        if not item.prompt:
            raise CLIError(f"{item.where}: prompt is empty")
        check_prompt_text(item.where, item.prompt)
    return items


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read().removeprefix("\ufeff")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CLIError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise CLIError(f"input file {path} is a directory") from None
    except OSError as e:
        raise CLIError(f"cannot read input file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a BOM is not part of a prompt
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise CLIError(f"{path} line {line}: not valid UTF-8 text") from None


def read_items(path: str, base: dict[str, Any], param_names: Iterable[str]) -> list[Item]:
    text = _read_text(path)
    name = "stdin" if path == "-" else path
    lines = text.split("\n")
    jsonl = path.lower().endswith(".jsonl") or text.lstrip().startswith("{")
    items: list[Item] = []
    allowed = set(param_names)
    for i, raw in enumerate(lines):
        line = raw[:-1] if raw.endswith("\r") else raw
        if not line.strip():
            continue
        where = f"{name} line {i + 1}"
        if not jsonl:
            check_prompt_text(where, line)
            items.append(Item(i, where, line, dict(base), len(items), i + 1))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise CLIError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        item_id = obj.get("id", i)
        if isinstance(item_id, bool) or not isinstance(item_id, (int, str)):
            raise CLIError(f"{where}: id must be a string or an integer, got {item_id!r}")
        if "id" in obj:
            where = f"{where} (id {describe_id(item_id)})"
        has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_text == has_ids:
            raise CLIError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
        if has_text:
            prompt = obj["prompt"]
            if not isinstance(prompt, str):
                raise CLIError(f"{where}: prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise CLIError(f"{where}: prompt is empty")
            check_prompt_text(where, prompt)
        else:
            prompt = obj["prompt_token_ids"]
            if (
                not isinstance(prompt, list)
                or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                raise CLIError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        knobs = dict(base)
        if any(key in obj for key in _CONSTRAINT_KNOBS):  # the line's replaces the flags'
            knobs = {k: v for k, v in knobs.items() if k not in _CONSTRAINT_KNOBS}
        for key, value in obj.items():
            if key in ("id", "prompt", "prompt_token_ids"):
                continue
            if key not in allowed:
                raise CLIError(
                    f"{where}: unknown key {key!r}; a line holds id, prompt or "
                    f"prompt_token_ids, and sampling settings ({', '.join(sorted(allowed))})"
                )
            knobs[key] = _normalise_override(key, value, where)
        items.append(Item(item_id, where, prompt, knobs, len(items), i + 1))
    if not items:
        raise CLIError(f"{name} holds no prompts")
    seen: dict[tuple[str, Any], Item] = {}
    for item in items:
        key = id_key(item.id)
        if key in seen:
            raise CLIError(
                f"duplicate id {describe_id(item.id)} in {name}: lines {seen[key].line} "
                f"and {item.line}"
            )
        seen[key] = item
    return items


def prepare_tokens(items: Sequence[Item], info, defaults) -> None:
    """Tokenize every prompt and check it against the vocabulary and the context."""
    for item in items:
        if isinstance(item.prompt, str):
            if info.tokenizer is None:
                raise CLIError(
                    f"{item.where}: the model has no tokenizer.json, so prompts must be given "
                    "as prompt_token_ids in a JSONL file"
                )
            ids = list(info.tokenizer.encode(item.prompt))
            if not ids:
                raise CLIError(f"{item.where}: the prompt encodes to no tokens")
        else:
            ids = list(item.prompt)
            for t in ids:
                if not 0 <= t < info.vocab_size:
                    raise CLIError(
                        f"{item.where}: prompt_token_ids holds token id {t}, outside the "
                        f"vocabulary range [0, {info.vocab_size - 1}]"
                    )
        max_tokens = int(float(item.knobs.get("max_tokens", defaults["max_tokens"])))
        if len(ids) + max_tokens > info.max_length:
            raise CLIError(
                f"{item.where}: the prompt has {len(ids)} tokens and max_tokens = {max_tokens}: "
                f"together {len(ids) + max_tokens}, over the model's context of "
                f"{info.max_length} tokens"
            )
        item.token_ids = ids


def job_bounds(items: Sequence[Item], info, defaults) -> dict[str, int]:
    """Longest prompt and largest max_tokens over every input line, done ones included, so
    that a resumed run decodes with the same shapes as an uninterrupted one."""
    longest, most = 1, 1
    for item in items:
        if item.token_ids is not None:
            length = len(item.token_ids)
        elif isinstance(item.prompt, str):
            length = len(info.tokenizer.encode(item.prompt)) if info.tokenizer else 1
        else:
            length = len(item.prompt)
        longest = max(longest, length)
        most = max(most, int(float(item.knobs.get("max_tokens", defaults["max_tokens"]))))
    cap = info.max_length - 1
    return {"max_prompt_len": min(longest, cap), "max_tokens": min(most, cap)}


# --------------------------------------------------------------------------- results


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _completion(result, row: int, want_logprobs: bool) -> dict[str, Any]:
    out = {
        "text": result.text[row] if result.text is not None else None,
        "token_ids": result.token_ids[row],
        "num_tokens": result.num_tokens[row],
        "finish_reason": result.finish_reason[row],
        "stop_reason": result.stop_reason[row],
    }
    if result.error is not None and result.error[row] is not None:
        out["error"] = result.error[row]
    if want_logprobs:
        out["logprobs"] = [_finite(x) for x in result.logprobs[row]]
        out["raw_logprobs"] = [_finite(x) for x in result.raw_logprobs[row]]
        if result.top_logprobs is not None:
            out["top_logprobs"] = [
                [[int(t), _finite(v)] for t, v in sorted(d.items(), key=lambda kv: -kv[1])]
                for d in result.top_logprobs[row]
            ]
    return out


def record(item: Item, result, n: int) -> dict[str, Any]:
    """The output line of a done prompt: its `n` completions (a list per field when n > 1)."""
    want = int(float(item.knobs.get("logprobs") or 0)) > 0
    outs = [_completion(result, k, want) for k in range(n)]
    rec: dict[str, Any] = {"id": item.id, "prompt": item.prompt}
    if n == 1:
        rec.update(outs[0])
    else:
        keys = dict.fromkeys(k for o in outs for k in o)
        for key in keys:
            rec[key] = [o.get(key) for o in outs]
    return rec
