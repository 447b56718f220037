"""A prompt's request settings: the keys of a JSONL line (or a Ray Data row) that go to
its `ll.Request`, not to `SamplingParams.create`. They are kept with the sampling
settings (a line's replaces the job's, key by key) as JSON values, and checked by the
library's own checks, named by the line:

- "adapter": its LoRA adapter in the job's table by name (null: the base model).
- "guidance_scale", "negative_prompt": its classifier-free guidance (docs/guidance.md):
  a finite number (1: unguided), and text or a list of token ids.
- "steer": its steering vectors (docs/inside.md): an object with `ll.Steer`'s fields
  ("vector": a list of numbers of the model's hidden size, "layer": a decoder layer,
  "scale": a number, default 1, "tokens": "prompt", "generated" or "both", the default;
  a null field takes the default), or a list of such objects (several layers; [] for
  none).

What needs no model is checked when the line is read (`normalise`); the negative prompt's
tokens and context, a vector's width and a layer's range once the model is loaded
(`check_requests`). Nothing read from a file runs code: every value is JSON data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from logitloop.jobs import JobError

ADAPTER_KEY = "adapter"
GUIDANCE_KEYS = ("guidance_scale", "negative_prompt")
STEER_KEY = "steer"
REQUEST_KEYS = (ADAPTER_KEY, *GUIDANCE_KEYS, STEER_KEY)
STEER_FIELDS = ("vector", "layer", "scale", "tokens")  # ll.Steer's


def normalise(name: str, value: Any, where: str) -> Any:
    """One line's request setting `name` (one of `REQUEST_KEYS`, not None), checked as far
    as it can be without the model; a JobError names `where` and the key."""
    from logitloop.decoding.engine.guidance import check_scale
    from logitloop.decoding.engine.host import check_prompt

    if name == ADAPTER_KEY:
        if not isinstance(value, str) or not value:
            raise JobError(f"{where}: adapter must be an adapter's name or null, got {value!r}")
        return value
    try:
        if name == "guidance_scale":
            check_scale(name, value)
        elif name == "negative_prompt":
            check_prompt(name, value)
        else:
            _steers(value, None, None)  # the layer's range and the width: later
    except ValueError as e:
        raise JobError(f"{where}: {e}") from None
    return value


def _steer_objects(value: Any) -> list[dict[str, Any]]:
    """A line's "steer" (an object or a list of them) as a list of objects, null fields
    left out (`ll.Steer`'s defaults: a Ray column of structs fills a field a row lacks
    with null)."""
    entries = value if isinstance(value, list) else [value]
    out = []
    for k, entry in enumerate(entries):
        name = STEER_KEY if len(entries) == 1 else f"{STEER_KEY}[{k}]"  # as row_steers
        if not isinstance(entry, dict):
            raise ValueError(
                f"{name} must be an object with ll.Steer's fields ({', '.join(STEER_FIELDS)}) "
                f"or a list of them, got {entry!r}"
            )
        entry = {key: v for key, v in entry.items() if v is not None}
        unknown = [key for key in entry if key not in STEER_FIELDS]
        missing = [key for key in ("vector", "layer") if key not in entry]
        if unknown or missing:
            what = f"unknown key {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
            raise ValueError(
                f"{name} has {what}; an ll.Steer's fields are {', '.join(STEER_FIELDS)} "
                "(vector and layer required)"
            )
        vector = entry["vector"]
        if not isinstance(vector, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector
        ):
            raise ValueError(f"{name}.vector must be a list of numbers, got {vector!r}")
        out.append(entry)
    return out


def steers(value: Any) -> list[Any] | None:
    """A line's "steer" as `ll.Steer`s (None: none given)."""
    import numpy as np

    from logitloop.decoding.engine.inside import Steer

    if value is None:
        return None
    return [
        Steer(**{**entry, "vector": np.asarray(entry["vector"], np.float64)})
        for entry in _steer_objects(value)
    ]


def _steers(value: Any, num_layers: int | None, width: int | None, prompt_len: int = 1) -> None:
    """`value` checked as `generate_many` checks a request's `steer` (`inside.row_steers`)."""
    from logitloop.decoding.engine.inside import row_steers

    row_steers(steers(value), STEER_KEY, prompt_len, num_layers, width)


def request_kwargs(item) -> dict[str, Any]:
    """A prompt's `ll.Request` keywords from its settings (`item.knobs`)."""
    knobs = item.knobs
    return {
        "adapter": knobs.get(ADAPTER_KEY),
        "guidance_scale": knobs.get("guidance_scale"),
        "negative_prompt": knobs.get("negative_prompt"),
        "steer": steers(knobs.get(STEER_KEY)),
    }


def check_requests(items: Sequence[Any], info) -> None:
    """Every prompt's guidance and steering against the loaded model, as `generate_many`
    checks them: the negative prompt's tokens and its context beside the row's
    max_tokens (`guidance.guided_prompts`), each vector's width and layer
    (`inside.row_steers`). Items with token ids (`prepare_tokens`) and params."""
    from logitloop.decoding.engine.guidance import guided_prompts
    from logitloop.decoding.engine.plan import model_layers

    for item in items:
        knobs = item.knobs
        try:
            if any(knobs.get(key) is not None for key in GUIDANCE_KEYS):
                guided_prompts(
                    info, [item.token_ids], knobs.get("guidance_scale"),
                    knobs.get("negative_prompt"), item.params,
                )  # fmt: skip
            if knobs.get(STEER_KEY) is not None:
                layers, width = model_layers(info), info.residual_width
                _steers(knobs[STEER_KEY], layers, width, len(item.token_ids))
        except ValueError as e:
            raise JobError(f"{item.where}: {e}") from None


def negative_length(item, info) -> int:
    """The tokens of a guided prompt's negative prompt (0: unguided; a bad one is refused
    by `check_requests`), for the job's longest prompt."""
    from logitloop.decoding.engine.host import tokenize_prompt

    scale, negative = item.knobs.get("guidance_scale"), item.knobs.get("negative_prompt")
    if scale is None or negative is None:
        return 0  # unguided, or the prompt's last token
    try:
        return len(tokenize_prompt("negative_prompt", negative, info))
    except ValueError as e:
        raise JobError(f"{item.where}: {e}") from None


def may_guide(items: Sequence[Any]) -> dict[str, Any]:
    """`generate_many` keywords for a job read from a generator of requests: with a guided
    prompt among `items`, the job's default scale 1 (unguided), which tells it up front
    that a request may guide (its default `prefill_batch` then prefills a pair)."""
    if any(item.knobs.get("guidance_scale") is not None for item in items):
        return {"guidance_scale": 1.0}
    return {}


def refuse_requests(items: Sequence[Any], runs: str, keys: Sequence[str] = ()) -> None:
    """Refuse `keys` (default guidance and steering), by line, in a job that `runs` none
    of them (beam search; speculative decoding takes no guidance yet)."""
    for item in items:
        for key in keys or (*GUIDANCE_KEYS, STEER_KEY):
            if item.knobs.get(key) is not None:
                raise JobError(f"{item.where}: {key} does not run with {runs} yet")
