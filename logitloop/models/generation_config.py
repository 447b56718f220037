"""The sampling settings a checkpoint recommends: its `generation_config.json`.

`read_generation_config` reads them as `SamplingParams.create` arguments;
`SamplingParams.from_model` and `logitloop.decoding.sampling.params.generation_defaults` check them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from logitloop.models.json_file import read_json as _read_json

# generation_config.json key -> SamplingParams.create argument (the keys vLLM reads too).
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def checkpoint_dir(model: Any) -> Path | None:
    """The folder `load_pretrained` read the model from, or None (e.g. a FunctionModel)."""
    folder = getattr(model, "checkpoint_dir", None)
    return None if folder is None else Path(folder)


def read_generation_config(model: Any) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint's `generation_config.json` (its path, None without a folder) and the
    settings it recommends as `SamplingParams.create` arguments: temperature, top_k, top_p,
    min_p, repetition_penalty and max_new_tokens (as max_tokens), each only where the file
    sets it; `do_sample: false` means greedy (temperature 0), as in transformers. `model` is
    a loaded model or its checkpoint folder (a path). The values are not checked here."""
    folder = Path(model) if isinstance(model, (str, os.PathLike)) else checkpoint_dir(model)
    path = None if folder is None else folder / "generation_config.json"
    config = _read_json(path) if path is not None and path.is_file() else {}
    out = {
        name: config[key]
        for key, name in GENERATION_DEFAULTS.items()
        if config.get(key) is not None
    }
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return path, out
