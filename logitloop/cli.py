"""The `logitloop` command line.

    logitloop generate "Once upon a time" --temperature 0 --max-tokens 64
    logitloop generate --input prompts.jsonl --output out.jsonl --batch-size 32 --top-p 0.9
    python -m logitloop generate --stream "Hello"
    logitloop explain "Once upon a time" --temperature 0.8 --top-p 0.9 --plot knobs.png

`generate` takes prompts as arguments or from `--input FILE`:

- plain text: one prompt per line; blank lines are skipped; a prompt's id is its 0-based
  line number.
- JSONL (the file name ends in `.jsonl`, or its first non-blank character is `{`): one
  object per line with `"prompt"` (a string) or `"prompt_token_ids"` (a list of ids), an
  optional `"id"` (a string or an integer; default: the 0-based line number) and optional
  per-line sampling settings under `SamplingParams.create`'s argument names (`temperature`,
  `top_p`, `max_tokens`, `seed`, `stop`, `logit_bias`, ...). A line's setting replaces the
  command-line value for that line. Unknown keys are an error.

Prompts run with continuous batching (`logitloop.decoding.batching`): `--batch-size` rows
decode together, and between chunks of decode steps each row that finished takes the next
waiting prompt. The shapes are fixed for the whole job (from its longest prompt and largest
max_tokens), so it compiles once, plus once more when a line first asks for logprobs or stop
strings.

Without `--output` the completions are printed to stdout (one block per completion, headed
`==> ID <==` when there is more than one). With `--output FILE` every prompt gets one JSON
line, in input order:

    {"id", "prompt", "text", "token_ids", "num_tokens", "finish_reason", "stop_reason"}

plus `"logprobs"` (per token, under the final sampling distribution), `"raw_logprobs"`
(per token, log-softmax of the model's logits) and `"top_logprobs"` (per token, the top-n
raw alternatives as `[token_id, logprob]` pairs) for prompts whose `logprobs` is above 0.
With `-n N` > 1 each completion field holds a list of N values, one per sample. A line is
written (and fsync'ed) as soon as it and every line before it are done.

Resuming: when the output file exists, the ids already in it are skipped and the rest are
appended (a partial last line, left by a killed run, is cut off first), so re-running a
killed job with the same arguments neither duplicates nor loses a line. `--overwrite`
starts the file afresh instead: the new file replaces the old one with its first result, so
a job that fails before that (a bad line, a broken model) leaves the old results as they
were. A run holds a lock on its output: a second run on the same file fails, naming the
first one's process id. `--output -` writes the JSONL lines to stdout, as does a path that is
not a regular file (`/dev/stdout`); an output that is the input file is refused. See
`logitloop.cli_output`.

`explain` prints, for the token after one PROMPT, the top candidates with their probability
after each step of the sampler and the step that cut each one (see
`logitloop.decoding.explain`); `--plot FILE.png` also draws a temperature sweep, raw vs final
probabilities and `--draws` tokens from `ll.sample` against the final distribution. It takes
the same sampling flags as `generate` (those that act on the next token) and validates them
with the same messages.

Bad input (an invalid setting, an unreadable or malformed input file, a missing model, a
prompt too long for the model's context) prints one line, `logitloop: error: ...`, to
stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logitloop.cli_output import (
    JsonlOutput,
    OutputError,
    check_not_input,
    discard_stdout,
    id_key,
)

PROG = "logitloop"
EXIT_BAD_INPUT = 2


class CLIError(Exception):
    """Bad input: reported as one `logitloop: error: ...` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr like every other bad input."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        raise CLIError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------- sampling knobs


def _param_defaults() -> dict[str, Any]:
    """SamplingParams.create's keyword arguments and their defaults (the per-line keys)."""
    from logitloop.decoding.params import SamplingParams

    sig = inspect.signature(SamplingParams.create)
    return {
        name: p.default
        for name, p in sig.parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "vocab_size"
    }


_ID_LIST_KNOBS = ("banned_token_ids", "allowed_token_ids", "stop_token_ids")


def _parse_bias(text: str) -> tuple[int, float]:
    tok, sep, val = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS, got {text!r}")
    try:
        return int(tok), float(val)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN=BIAS with an integer token id and a number, got {text!r}"
        ) from None


_STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.?)", re.DOTALL)


def _parse_stop(text: str) -> str:
    """A `--stop` value with the usual escapes read: \\n \\t \\r \\0 \\\\ \\" \\' \\xHH \\uHHHH
    \\UHHHHHHHH (a shell passes `"\\n\\n"` as backslash-n twice). Other escapes are an error."""

    def one(match: re.Match) -> str:
        code = match.group(1)
        if code in _STOP_ESCAPES:
            return _STOP_ESCAPES[code]
        if code[:1] in ("x", "u", "U") and len(code) > 1:
            value = int(code[1:], 16)
            if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: \\{code} is not a Unicode character"
                )
            return chr(value)
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown escape \\{code}; the escapes are \\n \\t \\r \\0 \\\\ \\\" "
            "\\' \\xHH \\uHHHH \\UHHHHHHHH (write \\\\ for a backslash)"
        )

    return _ESCAPE.sub(one, text)


def _parse_id_sequence(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 13,198, got {text!r}"
        )
    return ids


def _base_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling settings given as flags (the others keep SamplingParams' defaults).

    A subcommand without some of the flags (`explain` has no stop strings) leaves them out.
    """
    flag = lambda name: getattr(args, name, None)
    knobs: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "max_tokens",
        "min_tokens",
        "logprobs",
    ):
        value = flag(name)
        if value is not None:
            knobs[name] = value
    if flag("logit_bias"):
        knobs["logit_bias"] = dict(args.logit_bias)
    if flag("ban"):
        knobs["banned_token_ids"] = list(args.ban)
    if flag("allow"):
        knobs["allowed_token_ids"] = list(args.allow)
    if flag("stop_token_id"):
        knobs["stop_token_ids"] = list(args.stop_token_id)
    if flag("stop_sequence"):
        knobs["stop_sequences"] = [list(s) for s in args.stop_sequence]
    if flag("stop"):
        knobs["stop"] = list(args.stop)
    if flag("include_stop_str_in_output"):
        knobs["include_stop_str_in_output"] = True
    return knobs


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


_ROW_INDEX = re.compile(r"\b([A-Za-z_]+)\[0\](?!\[)")


def _one_row_message(error: ValueError) -> str:
    """SamplingParams' message for a batch of one, without the `[0]` row index."""
    return _ROW_INDEX.sub(r"\1", str(error))


def _span(items: Sequence[Item]) -> str:
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


@dataclass
class Item:
    """One prompt of the job."""

    id: Any
    where: str  # names the prompt in messages: "prompts.jsonl line 4" or "prompt 1"
    prompt: str | list[int]
    knobs: dict[str, Any]
    position: int  # index in the input, for batching
    line: int = 0  # 1-based line in the input file (0 for a PROMPT argument)
    token_ids: list[int] | None = None


def _describe_id(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _check_prompt_text(where: str, text: str) -> None:
    from logitloop.decoding.params import check_text

    try:
        check_text("the prompt", text)
    except ValueError as e:
        raise CLIError(f"{where}: {e}") from None


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


def _read_items(path: str, base: dict[str, Any], param_names: Iterable[str]) -> list[Item]:
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
            _check_prompt_text(where, line)
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
            where = f"{where} (id {_describe_id(item_id)})"
        has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_text == has_ids:
            raise CLIError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
        if has_text:
            prompt = obj["prompt"]
            if not isinstance(prompt, str):
                raise CLIError(f"{where}: prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise CLIError(f"{where}: prompt is empty")
            _check_prompt_text(where, prompt)
        else:
            prompt = obj["prompt_token_ids"]
            if (
                not isinstance(prompt, list)
                or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                raise CLIError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        knobs = dict(base)
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
                f"duplicate id {_describe_id(item.id)} in {name}: lines {seen[key].line} "
                f"and {item.line}"
            )
        seen[key] = item
    return items


# --------------------------------------------------------------------------- output file


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


def _record(item: Item, result, first_row: int, n: int) -> dict[str, Any]:
    want = int(float(item.knobs.get("logprobs") or 0)) > 0
    outs = [_completion(result, first_row + k, want) for k in range(n)]
    rec: dict[str, Any] = {"id": item.id, "prompt": item.prompt}
    if n == 1:
        rec.update(outs[0])
    else:
        keys = dict.fromkeys(k for o in outs for k in o)
        for key in keys:
            rec[key] = [o.get(key) for o in outs]
    return rec


class _StdoutSink:
    def __init__(self, headers: bool):
        self.headers = headers
        self.blocks = 0

    def write(self, records: Sequence[dict[str, Any]], n: int) -> None:
        try:
            self._write(records, n)
        except BrokenPipeError:
            raise
        except OSError as e:
            discard_stdout()
            raise CLIError(f"cannot write stdout: {e.strerror or e}") from None

    def _write(self, records: Sequence[dict[str, Any]], n: int) -> None:
        out = sys.stdout
        for rec in records:
            texts = rec["text"] if n > 1 else [rec["text"]]
            for k, text in enumerate(texts):
                if text is None:  # no tokenizer: show the ids
                    ids = rec["token_ids"][k] if n > 1 else rec["token_ids"]
                    text = " ".join(map(str, ids))
                if self.headers:
                    sample = f" #{k}" if n > 1 else ""
                    sep = "\n" if self.blocks else ""
                    out.write(f"{sep}==> {rec['id']}{sample} <==\n")
                out.write(text + "\n")
                self.blocks += 1
        out.flush()

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the job


@dataclass
class _Batch:
    items: list[Item]
    params: Any = None
    padded: list[dict[str, Any]] = field(default_factory=list)


_PAD_KNOBS = {"max_tokens": 1}


def _make_params(rows: Sequence[dict[str, Any]], defaults: dict[str, Any], vocab_size=None):
    from logitloop.decoding.params import SamplingParams

    names = sorted({k for r in rows for k in r})
    kwargs = {}
    for name in names:
        values = [_row_value(name, r.get(name, defaults[name])) for r in rows]
        if name == "allowed_token_ids" and all(v is None for v in values):
            continue
        kwargs[name] = values
    return SamplingParams.create(len(rows), vocab_size=vocab_size, **kwargs)


def _batch_params(batch: _Batch, defaults, vocab_size=None):
    """Build (and so validate) a batch's params; a bad row is named by its input line."""
    rows = [it.knobs for it in batch.items] + batch.padded
    try:
        return _make_params(rows, defaults, vocab_size)
    except ValueError as batch_error:
        for item in batch.items:
            try:
                _make_params([item.knobs], defaults, vocab_size)
            except ValueError as e:
                raise CLIError(f"{item.where}: {_one_row_message(e)}") from None
        raise CLIError(f"{_span(batch.items)}: {batch_error}") from None


def _load_model(path: str | None, dtype: str | None):
    from logitloop.models import load_pretrained

    try:
        return load_pretrained(path, dtype=dtype)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot load the model from {path}: {e.strerror or e}") from None


def _prepare_tokens(items: Sequence[Item], info, defaults) -> None:
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


def _check_vocab(batch: _Batch, vocab_size: int, defaults) -> None:
    try:
        batch.params.check_vocab(vocab_size)
    except ValueError as e:
        _batch_params(batch, defaults, vocab_size)  # names the line when it can
        raise CLIError(f"{_span(batch.items)}: {e}") from None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _fmt_rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds > 0 else "n/a"


def _stream_one(ll, model, item: Item, params, ignore_eos: bool) -> int:
    """Print one prompt's text deltas as they come; returns the number of tokens generated."""
    stream = getattr(ll, "stream", None)
    if stream is None:
        raise CLIError("--stream needs logitloop.stream, which this installation does not have")
    out = sys.stdout
    tokens = 0
    try:
        for event in stream(model, [item.token_ids], params, ignore_eos=ignore_eos):
            if event.text:
                out.write(event.text)
                out.flush()
            tokens += len(event.token_ids)
    except ValueError as e:
        raise CLIError(f"{item.where}: {e}") from None
    out.write("\n")
    out.flush()
    return tokens


def _generate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    quiet = args.quiet

    def note(message: str) -> None:
        if not quiet:
            print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    def warn(message: str) -> None:
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)

    if args.input is not None and args.prompts:
        raise CLIError("give prompts as arguments or with --input FILE, not both")
    if args.input is None and not args.prompts:
        raise CLIError("no prompts: give PROMPT arguments or --input FILE")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size = {args.batch_size} is outside the allowed range [1, inf)")
    if args.n < 1:
        raise CLIError(f"-n = {args.n} is outside the allowed range [1, inf)")
    if args.stream:
        if args.input is not None or len(args.prompts) != 1 or args.output or args.n != 1:
            raise CLIError("--stream takes exactly one PROMPT, with -n 1 and no --input/--output")
    if args.overwrite and not args.output:
        raise CLIError("--overwrite needs --output FILE")
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise CLIError(f"model folder not found: {args.model}")

    defaults = _param_defaults()
    base = _base_knobs(args)
    try:
        _make_params([base], defaults)
    except ValueError as e:
        raise CLIError(_one_row_message(e)) from None

    if args.input is not None:
        items = _read_items(args.input, base, defaults)
    else:
        items = [Item(i, f"prompt {i}", p, dict(base), i) for i, p in enumerate(args.prompts)]
        for item in items:
            if not item.prompt:
                raise CLIError(f"{item.where}: prompt is empty")
            _check_prompt_text(item.where, item.prompt)

    sink = None
    skipped = 0
    todo = items
    if args.output:
        check_not_input(args.output, args.input)
        sink = JsonlOutput.open(args.output, args.overwrite, warn)
        output = sink.name
        if sink.done:
            stray = len(sink.done - {id_key(it.id) for it in items})
            if stray:
                warn(f"{output} holds {stray} ids that are not in the input")
            todo = [it for it in items if id_key(it.id) not in sink.done]
            skipped = len(items) - len(todo)
    try:
        return _generate_job(args, items, todo, skipped, base, defaults, sink, note, started)
    finally:
        if sink is not None:
            sink.close()


def _generate_job(args, items, todo, skipped, base, defaults, sink, note, started) -> int:
    """The job after its inputs and output are settled: validate, load, generate."""
    output = None if sink is None else sink.name
    quiet = args.quiet

    # Fixed batches of consecutive input positions, padded to one call size.
    call_size = min(args.batch_size, len(items))
    batches: dict[int, _Batch] = {}
    for item in todo:
        batches.setdefault(item.position // args.batch_size, _Batch([])).items.append(item)
    batch_list = list(batches.values())
    for batch in batch_list:
        batch.padded = [dict(_PAD_KNOBS)] * (call_size - len(batch.items))
        batch.params = _batch_params(batch, defaults)

    if not todo:
        note(f"nothing to do: all {len(items)} prompts are already in {output}")
        return 0

    import logitloop as ll
    from logitloop.decoding.model import model_info

    t_load = time.perf_counter()
    model = _load_model(
        None if args.model is None else str(Path(args.model).expanduser()), args.dtype
    )
    info = model_info(model)
    load_s = time.perf_counter() - t_load
    _prepare_tokens(todo, info, defaults)
    try:  # token ids given as flags: report them as such, not as some prompt's
        _make_params([base], defaults, info.vocab_size)
    except ValueError as e:
        raise CLIError(_one_row_message(e)) from None
    for batch in batch_list:
        _check_vocab(batch, info.vocab_size, defaults)

    if sink is None:
        sink = _StdoutSink(headers=len(items) * args.n > 1)

    tokens = 0
    gen_started = time.perf_counter()
    from logitloop.decoding.compiles import CompileWatch

    with CompileWatch() as timer:
        if args.stream:
            tokens = _stream_one(ll, model, todo[0], batch_list[0].params, args.ignore_eos)
        else:
            shapes = dict(_job_bounds(items, info, defaults), slots=call_size)
            tokens = _run_batches(args, model, todo, defaults, shapes, sink, quiet, info)
    gen_s = time.perf_counter() - gen_started
    compile_s = timer.seconds

    where = f" into {output}" if output is not None else ""
    skip = f" ({skipped} already in {output}, skipped)" if skipped else ""
    note(
        f"{_plural(len(todo), 'prompt')}{skip}, {_plural(tokens, 'token')} generated{where} "
        f"in {gen_s:.1f} s wall "
        f"({_fmt_rate(tokens, gen_s)} tokens/s overall, "
        f"{_fmt_rate(tokens, gen_s - compile_s)} tokens/s excluding compile); "
        f"compile {compile_s:.1f} s (measured: JAX trace + lowering + XLA compile events "
        f"during generation); model load {load_s:.1f} s; total "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


# --------------------------------------------------------------------------- explain

_EXPLAIN_MAX_TOKENS = 2**31 - 1  # explain has no --max-tokens: min_tokens is bounded by itself


def _plot_formats() -> dict[str, str]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    return FigureCanvasAgg(Figure()).get_supported_filetypes()


def _explain(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise CLIError("prompt is empty")
    _check_prompt_text("PROMPT", args.prompt)
    if args.top < 1:
        raise CLIError(f"--top = {args.top} is outside the allowed range [1, inf)")
    if args.draws < 1:
        raise CLIError(f"--draws = {args.draws} is outside the allowed range [1, inf)")
    plot = None
    if args.plot is not None:
        plot = Path(args.plot).expanduser()
        formats = _plot_formats()
        suffix = plot.suffix.lower().lstrip(".")
        if suffix not in formats:
            raise CLIError(
                f"--plot {args.plot}: the file name must end in one of "
                f"{', '.join('.' + f for f in sorted(formats))}"
            )
        if not plot.parent.is_dir():
            raise CLIError(f"--plot {args.plot}: folder not found: {plot.parent}")
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise CLIError(f"model folder not found: {args.model}")

    defaults = _param_defaults()
    base = _base_knobs(args)
    base["max_tokens"] = _EXPLAIN_MAX_TOKENS
    try:
        _make_params([base], defaults)
    except ValueError as e:
        raise CLIError(_one_row_message(e)) from None

    from logitloop.decoding.explain import (
        draw_next_tokens,
        explain_next_token,
        explanation_figure,
        format_table,
    )
    from logitloop.decoding.model import model_info

    model = _load_model(
        None if args.model is None else str(Path(args.model).expanduser()), args.dtype
    )
    info = model_info(model)
    try:  # token ids given as flags, against the model's vocabulary
        params = _make_params([base], defaults, info.vocab_size)
    except ValueError as e:
        raise CLIError(_one_row_message(e)) from None
    if info.tokenizer is None:
        raise CLIError("the model has no tokenizer.json, so explain cannot encode PROMPT")
    ids = list(info.tokenizer.encode(args.prompt))
    if not ids:
        raise CLIError("the prompt encodes to no tokens")
    if len(ids) + 1 > info.max_length:
        raise CLIError(
            f"the prompt has {len(ids)} tokens: with the next one, over the model's context "
            f"of {info.max_length} tokens"
        )
    try:
        expl = explain_next_token(model, ids, params, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e)) from None
    sys.stdout.write(format_table(expl, args.top) + "\n")
    sys.stdout.flush()

    if plot is not None:
        draws = draw_next_tokens(expl, args.draws)
        fig = explanation_figure(expl, draws, top=args.top)
        try:
            fig.savefig(plot, dpi=100)
        except OSError as e:
            raise CLIError(f"cannot write {plot}: {e.strerror or e}") from None
        print(
            f"{PROG}: wrote {plot} ({len(fig.axes)} panels; {args.draws} draws from ll.sample)",
            file=sys.stderr,
            flush=True,
        )
    return 0


def _job_bounds(items: Sequence[Item], info, defaults) -> dict[str, int]:
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


def _run_batches(args, model, todo, defaults, shapes, sink, quiet: bool, info) -> int:
    """Generate every line with continuous batching; write records in input order."""
    from tqdm import tqdm

    from logitloop.decoding.batching import Request, iter_generate_many

    bar = tqdm(
        total=len(todo),
        unit="prompt",
        file=sys.stderr,
        disable=quiet or args.input is None,
        dynamic_ncols=True,
    )
    requests = (
        Request(it.token_ids, _make_params([it.knobs], defaults, info.vocab_size), id=it.id)
        for it in todo
    )
    tokens = 0
    finished: dict[int, dict[str, Any]] = {}
    written = 0
    try:
        results = iter_generate_many(
            model, requests, n=args.n, ignore_eos=args.ignore_eos, **shapes
        )
        for index, result in results:
            finished[index] = _record(todo[index], result, 0, args.n)
            tokens += sum(result.num_tokens)
            ready = []
            while written in finished:
                ready.append(finished.pop(written))
                written += 1
            if ready:
                sink.write(ready, args.n)
            bar.update(1)
            bar.set_postfix(tokens=tokens, refresh=False)
    except ValueError as e:
        request = re.match(r"requests\[(\d+)\](?: \(id .*?\))?: ", str(e))
        if request and int(request.group(1)) < len(todo):  # one request: name its line
            where, message = todo[int(request.group(1))].where, str(e)[request.end() :]
            raise CLIError(f"{where}: {_one_row_message(ValueError(message))}") from None
        raise CLIError(f"{_span(todo)}: {e}") from None
    finally:
        bar.close()
    return tokens


# --------------------------------------------------------------------------- argparse


_EXPLAIN_HELP = """\
Columns: raw = softmax of the model's logits; then the distribution after masks, bias and
penalties, after temperature, after top-k, after top-p, and after min-p (the final one,
which ll.sample draws from), each renormalised over the tokens that step keeps.
Bad input exits with status 2 and one "logitloop: error: ..." line on stderr, with the same
messages as generate.
"""


_JSONL_HELP = """\
JSONL input: one object per line, e.g.
  {"id": "q1", "prompt": "Once upon a time", "temperature": 0.8, "seed": 3, "max_tokens": 64}
  {"prompt_token_ids": [1, 415, 2936], "stop": ["\\n\\n"], "logprobs": 5}
Per-line keys are SamplingParams.create's arguments and replace the flags for that line.

Output (--output FILE.jsonl): one line per prompt, in input order:
  {"id", "prompt", "text", "token_ids", "num_tokens", "finish_reason", "stop_reason"}
  plus "logprobs", "raw_logprobs", "top_logprobs" when logprobs > 0.
An existing output file is resumed: ids already in it are skipped.
Bad input exits with status 2 and one "logitloop: error: ..." line on stderr.
Compiled programs are kept between runs in ~/.cache/logitloop/jax (XDG_CACHE_HOME is
honoured); LOGITLOOP_COMPILE_CACHE=DIR puts them elsewhere, LOGITLOOP_COMPILE_CACHE=off or
--no-compile-cache compiles afresh every run.
"""


def build_parser() -> argparse.ArgumentParser:
    from logitloop import __version__

    parser = _Parser(
        prog=PROG,
        description="logitloop: per-row sampling and a jit-compiled decode loop for JAX models.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions, printed to stdout or written as JSONL.",
        epilog=_JSONL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (one or more)")

    io = gen.add_argument_group("input and output")
    io.add_argument(
        "-i",
        "--input",
        metavar="FILE",
        help="prompts, one per line, or JSONL (.jsonl or first character '{'); '-' = stdin",
    )
    io.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write JSONL results here (resumes when it exists)",
    )
    io.add_argument(
        "--overwrite", action="store_true", help="start --output afresh instead of resuming"
    )
    io.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="N",
        help="prompts decoded together (continuous batching slots; default: 32)",
    )
    io.add_argument("--stream", action="store_true", help="print text as it is generated")
    io.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no final summary"
    )

    _add_model_flags(gen)

    s = gen.add_argument_group(
        "sampling (defaults: SamplingParams.create's; JSONL lines may override each)"
    )
    _add_sampling_flags(s, generation=True)

    _add_explain_parser(sub)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="PATH",
        help="Hugging Face checkpoint folder (default: the model shipped with logitloop)",
    )
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="parameter dtype (default: the checkpoint's own)",
    )
    model.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep compiled programs between runs (see LOGITLOOP_COMPILE_CACHE below)",
    )


COMPILE_CACHE_ENV = "LOGITLOOP_COMPILE_CACHE"


def compile_cache_dir() -> Path | None:
    """Where the CLI keeps JAX's compiled programs between runs, or None when it does not.

    `LOGITLOOP_COMPILE_CACHE`: a folder, or "0"/"off" to turn the cache off; unset: the
    per-user cache folder (`$XDG_CACHE_HOME/logitloop/jax`, `~/.cache/logitloop/jax`).
    """
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "logitloop" / "jax"


def use_compile_cache(enabled: bool) -> None:
    """Turn on JAX's persistent compilation cache, so that a second run of the same command
    loads its programs instead of compiling them. A cache the user configured for JAX
    (`JAX_COMPILATION_CACHE_DIR`, or `JAX_ENABLE_COMPILATION_CACHE=false`) is left as it is."""
    import jax

    folder = compile_cache_dir() if enabled else None
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # Every program, however quick to compile: the CLI's small ones add up to seconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _add_sampling_flags(s, *, generation: bool) -> None:
    """The sampling knobs, one flag each; `generation=False` (explain) leaves out those that
    only matter after the next token (max tokens, stop strings and sequences, logprobs, -n)."""
    s.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: 1.0)")
    s.add_argument("--top-k", type=int, metavar="K", help="<= 0 disables (default: 0)")
    s.add_argument("--top-p", type=float, metavar="P", help="in (0, 1] (default: 1.0)")
    s.add_argument("--min-p", type=float, metavar="P", help="in [0, 1] (default: 0.0)")
    s.add_argument("--repetition-penalty", type=float, metavar="R", help="> 0 (default: 1.0)")
    s.add_argument("--presence-penalty", type=float, metavar="X", help="in [-2, 2] (default: 0)")
    s.add_argument("--frequency-penalty", type=float, metavar="X", help="in [-2, 2] (default: 0)")
    s.add_argument(
        "--logit-bias",
        type=_parse_bias,
        action="append",
        metavar="TOKEN=BIAS",
        help="add BIAS (in [-100, 100]) to token id TOKEN's logit (repeatable)",
    )
    s.add_argument(
        "--ban", type=int, action="append", metavar="TOKEN", help="ban token id (repeatable)"
    )
    s.add_argument(
        "--allow",
        type=int,
        action="append",
        metavar="TOKEN",
        help="allow only these token ids (repeatable)",
    )
    s.add_argument("--seed", type=int, metavar="S", help="per-row random seed (default: 0)")
    if generation:
        s.add_argument("--max-tokens", type=int, metavar="N", help="(default: 16)")
    s.add_argument("--min-tokens", type=int, metavar="N", help="(default: 0)")
    if generation:
        s.add_argument(
            "--stop",
            type=_parse_stop,
            action="append",
            metavar="STR",
            help="stop string (repeatable); backslash escapes are read: \\n \\t \\r \\\\ "
            "\\xHH \\uHHHH (so --stop '\\n\\n' stops at a blank line)",
        )
    s.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        metavar="TOKEN",
        help="stop after this token id (repeatable; the model's EOS is always one)",
    )
    if generation:
        s.add_argument(
            "--stop-sequence",
            type=_parse_id_sequence,
            action="append",
            metavar="ID,ID,...",
            help="stop after this token-id sequence (repeatable)",
        )
        s.add_argument(
            "--include-stop-str-in-output",
            action="store_true",
            help="keep a matched stop string in the text",
        )
        s.add_argument(
            "--logprobs",
            type=int,
            metavar="N",
            help="record logprobs and the top-N raw alternatives, N in [0, 20] (default: 0)",
        )
        s.add_argument(
            "-n", "--n", type=int, default=1, metavar="N", help="samples per prompt (default: 1)"
        )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")


def _add_explain_parser(sub) -> None:
    ex = sub.add_parser(
        "explain",
        help="show what every sampling knob does to the next token",
        description=(  # RawDescriptionHelpFormatter prints it as is: lines kept short
            "For the token after PROMPT, print a table of the top candidates: the model's\n"
            "raw probability, the probability after each step of the sampler (masks, bias\n"
            "and penalties; temperature; top-k; top-p; min-p = final) and the step that cut\n"
            "each token. The numbers come from the sampler's own code."
        ),
        epilog=_EXPLAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("prompt", metavar="PROMPT", help="prompt text")
    out = ex.add_argument_group("output")
    out.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="N",
        help="candidates to show: the N most likely after masks, bias and penalties, plus any "
        "of the model's own N most likely they pushed out (default: 10)",
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write a figure: temperature sweep, raw vs final, draws (needs matplotlib)",
    )
    out.add_argument(
        "--draws",
        type=int,
        default=2000,
        metavar="N",
        help="tokens drawn with ll.sample (seeds S, S+1, ...) for --plot (default: 2000)",
    )
    _add_model_flags(ex)
    s = ex.add_argument_group("sampling (defaults: SamplingParams.create's)")
    _add_sampling_flags(s, generation=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, 2 for bad input, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # pragma: no cover - a detached or odd stream
                pass
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_BAD_INPUT
        use_compile_cache(args.compile_cache)
        if args.command == "explain":
            return _explain(args)
        return _generate(args)
    except (CLIError, OutputError) as e:
        message = " ".join(str(e).splitlines())
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # Output piped into a reader that went away (`... | head`): stop quietly.
        discard_stdout()
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
