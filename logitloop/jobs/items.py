"""A job's prompts: read from arguments or input files (plain text or JSONL), each with its
sampling settings validated by `SamplingParams.create` once, tokenized and checked against
the model, and turned into one output record when done.

A message about one prompt names it by where it came from ("prompts.jsonl line 4 (id
"q1")", "prompt 1"), followed by the library's own message for that row, untouched: each
prompt's settings are a `SamplingParams` of one row, whose messages name no row index
("top_p = 1.5 ..."), and its prompt is checked by `logitloop.decoding.engine.host`
(`check_prompt`, `tokenize_prompt`, `check_context`). Bad input is a `JobError`.
"""

from __future__ import annotations

import glob
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logitloop.jobs import JobError
from logitloop.jobs.request_keys import ADAPTER_KEY, REQUEST_KEYS, negative_length, normalise
from logitloop.jobs.sinks import describe_id, id_key


@dataclass
class Item:
    """One prompt of the job."""

    id: Any
    where: str  # names the prompt in messages: "prompts.jsonl line 4" or "prompt 1"
    prompt: str | list[int] | None  # None for a conversation until `render_conversations`
    knobs: dict[str, Any]  # SamplingParams.create's arguments for this prompt
    position: int  # index in the input
    line: int = 0  # 1-based line in the input file (0 for a PROMPT argument)
    token_ids: list[int] | None = None  # set by `prepare_tokens`
    params: Any = None  # SamplingParams of batch 1, set by `validate_params`
    messages: list[dict[str, Any]] | None = None  # a JSONL line's conversation


# --------------------------------------------------------------------------- sampling settings


def param_defaults() -> dict[str, Any]:
    """SamplingParams.create's keyword arguments and their defaults (the per-line keys,
    `max_new_tokens` included: `read_items` stores it as `max_tokens`)."""
    from logitloop.decoding.sampling.params import SamplingParams

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
    if name in REQUEST_KEYS:  # its request's, not a sampling setting (`request_keys`)
        return normalise(name, value, where)
    if name == "logit_bias":
        if not isinstance(value, dict):
            raise JobError(f"{where}: logit_bias must be an object of token id -> bias")
        out = {}
        for key, bias in value.items():
            try:
                tok = int(key)
            except ValueError:
                raise JobError(
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
            raise JobError(f"{where}: {name} must be a list of integer token ids, got {value!r}")
        return value
    if name == "stop":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise JobError(f"{where}: stop must be a string or a list of strings, got {value!r}")
        return value
    if name == "stop_sequences":
        if not isinstance(value, list) or not all(
            isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in s)
            for s in value
        ):
            raise JobError(
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


def row_params(knobs: dict[str, Any], where: str | None = None):
    """`SamplingParams.create` of one row (which validates every setting); a bad setting is a
    JobError naming `where` (nothing: a flag)."""
    from logitloop.decoding.sampling.params import SamplingParams

    kwargs = {
        name: [_row_value(name, value)]
        for name, value in knobs.items()
        # None: every token allowed; the request's settings are not sampling settings
        if not (name == "allowed_token_ids" and value is None) and name not in REQUEST_KEYS
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


def _row_error(where: str | None, error: Exception) -> JobError:
    return JobError(str(error) if where is None else f"{where}: {error}")


def check_prompt(where: str, prompt: str | list[int]) -> None:
    """The library's check of a prompt before the model is loaded (`host.check_prompt`)."""
    from logitloop.decoding.engine.host import check_prompt

    try:
        check_prompt(_prompt_name(prompt), prompt)
    except ValueError as e:
        raise _row_error(where, e) from None


def _prompt_name(prompt: str | list[int]) -> str:
    return "the prompt" if isinstance(prompt, str) else "prompt_token_ids"


def validate_params(items: Sequence[Item], base: dict[str, Any], base_params) -> None:
    """Each prompt's SamplingParams, built once: the flags' own (`base_params`) for a prompt
    that overrides nothing."""
    for item in items:
        item.params = base_params if item.knobs == base else row_params(item.knobs, item.where)


def check_adapters(items: Sequence[Item], loaded: Sequence[str]) -> None:
    """Every prompt's adapter (a line's "adapter") is one of the job's `loaded` names."""
    for item in items:
        name = item.knobs.get(ADAPTER_KEY)
        if name is not None and name not in loaded:
            given = ", ".join(loaded) if loaded else "none"
            raise JobError(
                f"{item.where}: adapter {name!r} is not one of the job's adapters (loaded: "
                f"{given}; --adapter NAME=PATH loads one)"
            )


def adapter_rows(adapters, items: Sequence[Item]) -> dict[str, Any]:
    """`adapters=` (the job's table, or None) and each item's `adapter=`, as `ll.stream`
    and `ll.beam_search` take them; nothing without a table."""
    if adapters is None:
        return {}
    return {"adapters": adapters, "adapter": [it.knobs.get(ADAPTER_KEY) for it in items]}


def request_error(items: Sequence[Item], error: Exception) -> JobError:
    """The library's error about a job of `items`, named by the item it is about (it names
    one request "requests[3]: ..."), else by the whole run (`span`)."""
    found = re.match(r"requests\[(\d+)\]: ", str(error))
    if found and int(found[1]) < len(items):
        return JobError(f"{items[int(found[1])].where}: {str(error)[found.end() :]}")
    return JobError(f"{span(items)}: {error}")


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
        check_prompt(item.where, item.prompt)
    return items


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read().removeprefix("\ufeff")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise JobError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise JobError(f"input file {path} is a directory") from None
    except OSError as e:
        raise JobError(f"cannot read input file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a BOM is not part of a prompt
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise JobError(f"{path} line {line}: not valid UTF-8 text") from None


PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")  # a JSONL line has one of them


def _conversation(value: Any, where: str) -> list[dict[str, Any]]:
    """A line's `messages`: a non-empty list of objects, each with a string 'role' (the
    template checks the rest when it renders them)."""
    if not isinstance(value, list) or not value:
        raise JobError(f"{where}: messages must be a non-empty list of {{'role', 'content'}}")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise JobError(
                f"{where}: messages[{index}] = {json.dumps(message)} is not a message: an "
                "object with a 'role' string and its 'content'"
            )
        content = message.get("content")
        if isinstance(content, str):  # the library's text check (no lone surrogates)
            from logitloop.decoding.sampling.checks import check_text

            try:
                check_text("content", content)
            except ValueError as e:
                raise _row_error(f"{where}, messages[{index}]", e) from None
    return value


def json_line(line: str, where: str, default_id: int) -> tuple[dict[str, Any], Any, str]:
    """One JSONL line (`where` names it, "prompts.jsonl line 4") as its object, its id
    (`default_id` when it has none) and its name with the id ("... (id 'a')"), or a
    JobError saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise JobError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise JobError(f"{where}: JSON nested too deep to read") from None
    if not isinstance(obj, dict):
        raise JobError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    item_id = obj.get("id", default_id)
    if isinstance(item_id, bool) or not isinstance(item_id, (int, str)):
        raise JobError(f"{where}: id must be a string or an integer, got {item_id!r}")
    if "id" in obj:
        where = f"{where} (id {describe_id(item_id)})"
    return obj, item_id, where


def object_item(
    obj: dict[str, Any],
    item_id: Any,
    where: str,
    base: dict[str, Any],
    allowed: set[str],
    position: int,
    line: int = 0,
) -> Item:
    """One prompt from a JSON object (a JSONL line, a Ray Data row): exactly one of
    'prompt', 'prompt_token_ids' and 'messages', and per-prompt sampling settings (names in
    `allowed`) that replace `base`'s; a JobError naming `where` says what is wrong."""
    given = [key for key in PROMPT_KEYS if key in obj]
    if len(given) != 1:
        both = f" (it has {' and '.join(given)})" if given else ""
        raise JobError(
            f"{where}: give exactly one of 'prompt', 'prompt_token_ids' and 'messages'{both}"
        )
    messages = None
    if given == ["messages"]:
        prompt, messages = None, _conversation(obj["messages"], where)
    else:
        has_text = given == ["prompt"]
        prompt = obj[given[0]]
        if not isinstance(prompt, str if has_text else list):
            key, kind = ("prompt", "a string") if has_text else ("prompt_token_ids", "a list")
            raise JobError(f"{where}: {key} must be {kind}, got {type(prompt).__name__}")
        check_prompt(where, prompt)
    knobs = dict(base)
    if any(key in obj for key in _CONSTRAINT_KNOBS):  # the line's replaces the flags'
        knobs = {k: v for k, v in knobs.items() if k not in _CONSTRAINT_KNOBS}
    try:  # aliases (max_new_tokens) under their own names, so they replace the flags'
        from logitloop.decoding.sampling.params import canonical_knobs

        obj = canonical_knobs(obj)
    except ValueError as e:
        raise JobError(f"{where}: {e}") from None
    for key, value in obj.items():
        if key == "id" or key in PROMPT_KEYS:
            continue
        if key not in allowed and key not in REQUEST_KEYS:
            raise JobError(
                f"{where}: unknown key {key!r}; a line holds id, prompt, "
                f"prompt_token_ids or messages, its request's settings "
                f"({', '.join(REQUEST_KEYS)}), and sampling settings "
                f"({', '.join(sorted(allowed))})"
            )
        knobs[key] = _normalise_override(key, value, where)
    return Item(item_id, where, prompt, knobs, position, line, messages=messages)


def read_items(
    path: str, base: dict[str, Any], param_names: Iterable[str], first_id: int = 0
) -> list[Item]:
    """The prompts of one input file. A line without an id gets `first_id` + its 0-based
    line number (`first_id`: the lines of the files before it, when a job reads several)."""
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
            check_prompt(where, line)
            items.append(Item(first_id + i, where, line, dict(base), len(items), i + 1))
            continue
        obj, item_id, where = json_line(line, where, first_id + i)
        items.append(object_item(obj, item_id, where, base, allowed, len(items), i + 1))
    if not items:
        raise JobError(f"{name} holds no prompts")
    seen: dict[tuple[str, Any], Item] = {}
    for item in items:
        key = id_key(item.id)
        if key in seen:
            raise JobError(
                f"duplicate id {describe_id(item.id)} in {name}: lines {seen[key].line} "
                f"and {item.line}"
            )
        seen[key] = item
    return items


def input_paths(pattern: str | Sequence[str]) -> list[str]:
    """The input files: a path, a glob ('data/*.jsonl'), or a list of them, sorted."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths: list[str] = []
    for p in patterns:
        found = sorted(glob.glob(os.path.expanduser(p))) if glob.has_magic(p) else [p]
        if not found:
            raise JobError(f"--input {p}: no file matches")
        paths.extend(found)
    return paths


def read_inputs(pattern: str | Sequence[str], base: dict[str, Any], defaults) -> list[Item]:
    """Every input file's prompts (`read_items`), as one job: a line without an id has its
    0-based line number in the files concatenated in sorted order; ids are unique over all
    files."""
    items: list[Item] = []
    seen: dict[tuple[str, Any], Item] = {}
    first = 0
    for path in input_paths(pattern):
        part = read_items(path, base, defaults, first_id=first)
        text = Path(path).read_text(encoding="utf-8")
        first += text.count("\n") + (0 if text.endswith("\n") else 1)
        for item in part:
            key = id_key(item.id)
            if key in seen:
                raise JobError(
                    f"duplicate id {describe_id(item.id)}: {seen[key].where} and {item.where}"
                )
            seen[key] = item
            item.position = len(items)
            items.append(item)
    return items


def prompt_ids(where: str, prompt: str | list[int], max_tokens: int, info) -> list[int]:
    """The prompt's token ids, checked against the model's vocabulary and its context with
    room for `max_tokens` more (`host.tokenize_prompt`, `host.check_context`)."""
    from logitloop.decoding.engine.host import check_context, tokenize_prompt

    try:
        ids = tokenize_prompt(_prompt_name(prompt), prompt, info)
        check_context("the prompt", ids, max_tokens, info)
    except ValueError as e:
        raise _row_error(where, e) from None
    return ids


def render_conversations(items: Sequence[Item], model, ignore_eos: bool) -> list[Item]:
    """Every conversation's prompt: its messages rendered with the model's chat template and
    tokenized (`conversation.chat_request`), and, unless `ignore_eos`, the end-of-turn ids
    added to its stop_token_ids (its params are built again from them). Done lines are
    rendered too: `job_bounds` reads every line's length. Returns the items it changed."""
    from logitloop.conversation import chat_request, model_template
    from logitloop.conversation import prompt_ids as conversation_ids

    chats = [item for item in items if item.messages is not None]
    if not chats:
        return []
    try:
        template = model_template(model)
    except ValueError as e:
        raise JobError(f"{chats[0].where}: messages need a chat template: {e}") from None
    for item in chats:
        try:  # the library's messages name the conversation by `where`
            if ignore_eos:  # neither EOS nor the end of a turn stops the reply
                ids = conversation_ids(
                    model, item.messages, chat_template=template, where=item.where
                )
            else:
                ids, item.knobs = chat_request(
                    model, item.messages, item.knobs, where=item.where, chat_template=template
                )
        except ValueError as e:
            raise JobError(str(e)) from None
        item.prompt = ids
        if not ignore_eos and item.params is not None:
            item.params = row_params(item.knobs, item.where)
    return chats


def prepare_tokens(items: Sequence[Item], info) -> None:
    """Tokenize every prompt and check it under its own max_tokens (`prompt_ids`)."""
    import numpy as np

    for item in items:
        max_tokens = int(np.asarray(item.params.max_tokens)[0])
        item.token_ids = prompt_ids(item.where, item.prompt, max_tokens, info)


def job_bounds(items: Sequence[Item], info, defaults) -> dict[str, int]:
    """Longest prompt (negative prompts included) and largest max_tokens over every input
    line, done ones included, so that a resumed run decodes with the same shapes as an
    uninterrupted one."""
    from logitloop.decoding.sampling.params import DEFAULT_MAX_TOKENS

    longest, most = 1, 1
    for item in items:
        if item.token_ids is not None:
            length = len(item.token_ids)
        elif isinstance(item.prompt, str):
            length = len(info.tokenizer.encode(item.prompt)) if info.tokenizer else 1
        else:
            length = len(item.prompt)
        longest = max(longest, length, negative_length(item, info))
        value = item.knobs.get("max_tokens")
        most = max(most, int(float(DEFAULT_MAX_TOKENS if value is None else value)))
    cap = info.max_length - 1
    return {"max_prompt_len": min(longest, cap), "max_tokens_bound": min(most, cap)}


# --------------------------------------------------------------------------- results


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _completion(result, row: int, want_logprobs: bool, tokenizer=None) -> dict[str, Any]:
    out = {
        "text": result.texts[row] if result.text is not None else None,
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
                [
                    [int(t), _finite(v), _token_text(tokenizer, int(t))]
                    for t, v in sorted(d.items(), key=lambda kv: -kv[1])
                ]
                for d in result.top_logprobs[row]
            ]
    return out


def _token_text(tokenizer, token: int) -> str | None:
    """One token's text, special tokens spelled out (None without a tokenizer); a token
    holding part of a UTF-8 character shows U+FFFD, as in vLLM's logprobs."""
    return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def record(item: Item, result, n: int, tokenizer=None) -> dict[str, Any]:
    """The output line of a done prompt: its `n` completions (a list per field when n > 1),
    and the seed it was drawn with (with `n`, that seed reproduces the line). Top logprobs
    are [token id, logprob, token text] (the text None without `tokenizer`)."""
    want = int(float(item.knobs.get("logprobs") or 0)) > 0
    outs = [_completion(result, k, want, tokenizer) for k in range(n)]
    if item.messages is not None:
        rec: dict[str, Any] = {"id": item.id, "messages": item.messages}
    else:
        rec = {"id": item.id, "prompt": item.prompt}
    rec["seed"] = item.knobs.get("seed", 0)
    if item.knobs.get(ADAPTER_KEY) is not None:
        rec[ADAPTER_KEY] = item.knobs[ADAPTER_KEY]
    if n == 1:
        rec.update(outs[0])
    else:
        keys = dict.fromkeys(k for o in outs for k in o)
        for key in keys:
            rec[key] = [o.get(key) for o in outs]
    return rec
