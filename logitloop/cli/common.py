"""What every part of the command line shares: its name, the bad-input error, loading the
model, the checkpoint's sampling defaults."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PROG = "logitloop"
EXIT_BAD_INPUT = 2


class CLIError(Exception):
    """Bad input: reported as one `logitloop: error: ...` line, exit status 2."""


def check_model_folder(path: str | None) -> None:
    if path is not None and not Path(path).expanduser().is_dir():
        raise CLIError(f"model folder not found: {path}")


def load_model(
    path: str | None,
    dtype: str | None,
    quantize: str | None = None,
    group_size: int | None = None,
    quantize_embedding: bool = False,
):
    """`load_pretrained` of the --model folder (None: the shipped model), with --quantize,
    --group-size and --quantize-embedding, errors as CLIError."""
    from logitloop.models.loading import load_pretrained

    path = None if path is None else str(Path(path).expanduser())
    try:
        return load_pretrained(
            path,
            dtype=dtype,
            quantize=quantize,
            group_size=group_size,
            quantize_embedding=quantize_embedding,
        )
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot load the model from {path}: {e.strerror or e}") from None


def checkpoint_defaults(args, *, show: bool = True) -> dict[str, Any]:
    """The sampling settings the --model folder's generation_config.json recommends
    (`logitloop.decoding.sampling.params.generation_defaults`), unless `--generation-config none`.
    When it sets any and `show`, one line on stderr names them and the file, as vLLM does at
    start: a flag (or a JSONL key) replaces a default of the same name."""
    if args.generation_config == "none":
        return {}
    from logitloop.decoding.sampling.params import generation_defaults
    from logitloop.models.loading import SHIPPED_MODEL_DIR

    folder = SHIPPED_MODEL_DIR if args.model is None else Path(args.model).expanduser()
    try:
        defaults = generation_defaults(folder)
    except ValueError as e:
        raise CLIError(f"{e} (--generation-config none ignores the file)") from None
    if defaults and show:
        settings = ", ".join(f"{name}={value}" for name, value in defaults.items())
        print(
            f"{PROG}: sampling defaults from {folder / 'generation_config.json'}: {settings} "
            "(flags override them; --generation-config none ignores them)",
            file=sys.stderr,
            flush=True,
        )
    return defaults
