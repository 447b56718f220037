"""Batch jobs of many prompts: the part that `logitloop generate` and the Ray integration
(`logitloop.integrations.ray`) share, below both of them, so that neither imports the other.

- `items.py`: a job's prompts, read from arguments or input files (plain text or JSONL, one
  file or several), each with its sampling settings checked once by `SamplingParams.create`,
  tokenized and checked against the model, and each done prompt's output record.
- `sinks.py`: where the records go: text on stdout, or a JSONL file that is resumed (the
  ids already there are skipped), locked, and written fresh without destroying an old one.

A bad input is a `JobError` whose message names the prompt ("prompts.jsonl line 4 (id
"q1")"), the setting and the allowed range: the command line prints it as one
`logitloop: error: ...` line (its `CLIError` is this class), the Ray integration raises it
as a ValueError. Only what a job needs is imported, when it needs it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["JobError", "load_adapters", "load_model"]


class JobError(Exception):
    """Bad input to a job, its message naming the prompt, file or setting at fault."""


def load_model(
    path: str | None,
    dtype: str | None,
    quantize: str | None = None,
    group_size: int | None = None,
    quantize_embedding: bool = False,
    revision: str | None = None,
):
    """`load_pretrained` of a job's model, a folder or a Hub repo id at `revision` (None:
    the shipped model), with its quantization settings; a missing or unreadable checkpoint
    is a JobError."""
    from logitloop.models.loading import load_pretrained

    path = None if path is None else str(Path(path).expanduser())
    try:
        return load_pretrained(
            path,
            revision=revision,
            dtype=dtype,
            quantize=quantize,
            group_size=group_size,
            quantize_embedding=quantize_embedding,
        )
    except (FileNotFoundError, ValueError) as e:
        raise JobError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise JobError(f"cannot load the model from {path}: {e.strerror or e}") from None


def load_adapters(model, adapters: dict[str, str] | None):
    """The job's LoRA adapters, `{name: PEFT adapter folder}`, loaded into one table
    (`ll.load_adapter`) of as many slots as adapters, of their largest rank (at least 1);
    None without adapters. A folder that does not load is a JobError naming the adapter."""
    if not adapters:
        return None
    from logitloop.models.adapters import Adapters, adapter_rank

    try:
        rank = max(adapter_rank(path) for path in adapters.values())
        table = Adapters.create(model, max_adapters=len(adapters), max_rank=rank)
        for name, path in adapters.items():
            try:
                table = table.load(str(Path(path).expanduser()), name=name)
            except ValueError as e:
                raise ValueError(f"adapter {name!r} ({path}): {e}") from None
    except ValueError as e:
        raise JobError(f"cannot load the adapters: {e}") from None
    return table
