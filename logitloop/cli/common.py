"""What every part of the command line shares: its name, the bad-input error, loading the
model."""

from __future__ import annotations

from pathlib import Path

PROG = "logitloop"
EXIT_BAD_INPUT = 2


class CLIError(Exception):
    """Bad input: reported as one `logitloop: error: ...` line, exit status 2."""


def check_model_folder(path: str | None) -> None:
    if path is not None and not Path(path).expanduser().is_dir():
        raise CLIError(f"model folder not found: {path}")


def load_model(path: str | None, dtype: str | None):
    """`load_pretrained` of the --model folder (None: the shipped model), errors as CLIError."""
    from logitloop.models.loading import load_pretrained

    path = None if path is None else str(Path(path).expanduser())
    try:
        return load_pretrained(path, dtype=dtype)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot load the model from {path}: {e.strerror or e}") from None
