"""Reading a checkpoint's JSON files (`loading`, `hub`, `generation_config`,
`conversation` share it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a checkpoint's config, generation config, index, chat
    template settings), as data: a missing file, one that is not UTF-8 JSON, nests past
    the parser's depth or is not an object is a named error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    except RecursionError as e:  # nested past the parser's depth
        raise ValueError(f"{path}: not valid JSON: nested too deeply") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
