"""Reuse before compiling: a call runs at the buckets of a program this process already
has, padded, when one fits; a new program compiles only when none does.

Every entry point picks its buckets (rows, prompt width, generation buffer, top-logprob
width, continuation width, ...) from what a call needs (`host.bucket`). Two calls that need
different buckets would run two programs, though the larger one serves both: padding rows,
columns and slots changes no row's values (dummy rows are the batch's first prompt, padding
columns are never attended, a wider top-logprob array is cut to each row's own `n`; with
`deterministic=True` bit for bit, docs/deterministic.md). So each entry point asks `fit`
for the buckets to run at:

    need = Shape(rows=2, width=16, buffer=64, top=0)
    run = reuse.fit(key, need)    # e.g. Shape(rows=8, width=16, buffer=64, top=20)
    ...                          # the call runs at `run`
    reuse.ran(key, run)          # from now on `run` serves smaller calls under `key`

`key` holds everything else that picks the program (the model's runner, the layout, the
options): two keys that differ never share buckets. `fit` returns the cheapest shape this
process ran under `key` that covers `need` in every field, within `MAX_PADDING` (a field
may grow at most that many times its need, or its floor in `FLOORS`, the top-logprob
width to any). When none does, a program compiles anyway: `fit` then returns
the fieldwise largest of `need` and the shapes run under `key`, each field within its
padding limit of `need`'s, so that the new program also serves the calls those shapes
served. The record is per process (the newest `KEPT_PER_KEY` shapes of each of the newest
`KEYS_KEPT` keys); it only ever changes which bucket a call pads to, never a value.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Hashable
from typing import Any

# How many times a field may grow by reuse (a row bucket of 8 serves calls of 1 row: a
# decode step's cost on an accelerator is the weights' bytes, not the rows; a prompt of 16
# columns may run at 64). Beyond that a call compiles its own program.
MAX_PADDING = 4
# A field's need counts as at least this much for its padding limit: 1 or 2 rows may run
# at 8, a continuation of 1 to 4 tokens at 16 columns (a short pass either way).
# A packed pass that feeds no continuation (`packed.PackShape.cont_tokens` 0) may run at
# any continuation bucket up to 4 x its smallest, and a pass of few key slots at up to
# 2048 (its keys are about its tokens, which pad to 256 and more).
FLOORS = {"rows": 2, "cont": 4, "cont_tokens": 128, "keys": 512}
# Fields that may grow without bound: the top-logprob width (0 or the one width,
# `MAX_TOP_LOGPROBS`: the loop computes 20 alternatives for a call that asks none).
UNBOUNDED = frozenset({"top"})
KEPT_PER_KEY = 32
KEYS_KEPT = 256  # the newest keys (models, layouts, options) whose shapes are kept

_lock = threading.Lock()
_ran: dict[Hashable, list[tuple[tuple[str, int], ...]]] = {}


def _items(shape: Any) -> tuple[tuple[str, int], ...]:
    if dataclasses.is_dataclass(shape):
        shape = dataclasses.asdict(shape)
    return tuple((k, int(v)) for k, v in shape.items())


def _covers(have: dict[str, int], need: dict[str, int]) -> bool:
    for name, n in need.items():
        h = have[name]
        if h < n:
            return False
        if name in UNBOUNDED:
            continue
        if h > MAX_PADDING * max(n, FLOORS.get(name, 1)):
            return False
    return True


def fit(key: Hashable, need: Any) -> Any:
    """The shape to run a call that needs `need` (a dataclass or dict of ints) at: the
    cheapest shape `ran` recorded under `key` that covers it (module docstring), else
    `need`. Returns the same type as `need`."""
    wanted = dict(_items(need))
    with _lock:
        candidates = [dict(s) for s in _ran.get(key, ()) if tuple(k for k, _ in s) == tuple(wanted)]
    fits = [s for s in candidates if _covers(s, wanted)]
    if fits:
        best = min(
            fits, key=lambda s: (math.prod(max(v, 1) for v in s.values()), tuple(s.values()))
        )
    else:  # a program compiles anyway: make it one that also serves the shapes run so far
        best = {
            name: max([n] + [s[name] for s in candidates if _covers({name: s[name]}, {name: n})])
            for name, n in wanted.items()
        }
    if dataclasses.is_dataclass(need):
        return dataclasses.replace(need, **best)
    return type(need)(best)


def ran(key: Hashable, shape: Any) -> None:
    """Record that a program of `shape` under `key` exists in this process (after the
    call that runs it, or `precompile` of it)."""
    item = _items(shape)
    with _lock:
        shapes = _ran.pop(key, [])  # re-inserted: the dict's order is the keys' recency
        if item in shapes:
            shapes.remove(item)
        shapes.append(item)
        del shapes[:-KEPT_PER_KEY]
        _ran[key] = shapes
        for old in list(_ran)[:-KEYS_KEPT]:
            del _ran[old]


def forget() -> None:
    """Forget every shape (tests; `jax.clear_caches()` drops the programs themselves)."""
    with _lock:
        _ran.clear()
