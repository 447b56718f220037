"""Counting and timing JAX compilations, from `jax.monitoring` events.

    with CompileWatch() as watch:
        ll.generate(model, prompts, params)
    watch.count    # XLA backend compilations while active (0: everything was cached)
    watch.seconds  # wall time spent tracing, lowering and compiling

The CLI reports `seconds`; the tests and benchmarks assert on `count` ("changing a value
compiles nothing"). One listener is registered for the process, the first time a watch is
entered; watches may nest (each sees the events while it is active).

`compile_stats()` (public as `ll.compile_stats`) is the process-wide record of the programs
logitloop's own jitted functions compiled (`runner.runner_jit` calls `record`), each with
the reason: the dimension of its call that no earlier program of that function had.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
import warnings
from typing import Any

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE,
)

_active: list[CompileWatch] = []
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event not in COMPILE_EVENTS or not _active:
        return
    now = time.perf_counter()
    for watch in _active:
        watch.intervals.append((now - duration, now))
        watch.count += event == BACKEND_COMPILE


class CompileWatch:
    """Compilations while active: `count` (backend compiles) and `seconds` (trace + lower +
    compile; overlapping intervals, a nested jit traced inside another, merged)."""

    def __init__(self):
        self.count = 0
        self.intervals: list[tuple[float, float]] = []

    def __enter__(self) -> CompileWatch:
        global _registered
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        self.count = 0
        self.intervals = []
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)

    @property
    def seconds(self) -> float:
        total, end = 0.0, -math.inf
        for a, b in sorted(self.intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


# --------------------------------------------------------------------------- which and why


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """One program a logitloop entry point compiled or loaded: which (`program`: the jitted
    function, "prefill", "decode", ...), how long (trace + lower + XLA compile, or reading
    it from the executable store) and why (`reason`: the dimension that was new, e.g.
    "rows 4 -> 8", "buffer_len 64 -> 128", or "the first program of its kind" in this
    process). `loaded`: read from disk, neither traced nor compiled
    (`decoding.runtime.executables`)."""

    program: str
    seconds: float
    reason: str
    loaded: bool = False


@dataclasses.dataclass
class CompileStats:
    """What logitloop's entry points compiled in this process (`compile_stats()`):
    `programs` compiled (traced, lowered and compiled, or found in JAX's persistent cache
    after tracing and lowering) in `seconds`, and `loaded` ones read whole from the
    executable store in `load_seconds` (`decoding.runtime.executables`)."""

    programs: int = 0
    seconds: float = 0.0
    events: list[CompileEvent] = dataclasses.field(default_factory=list)
    loaded: int = 0
    load_seconds: float = 0.0

    def summary(self) -> str:
        """One line: "3 programs compiled in 9.1 s: prefill (rows 4 -> 8), ...", or with
        programs loaded from disk "1 program compiled, 2 loaded in 1.2 s: ..."."""
        if not self.programs and not self.loaded:
            return "0 programs compiled"
        what = ", ".join(
            f"{e.program} ({'loaded' if e.loaded else e.reason})" for e in self.events[-6:]
        )
        more = f"{len(self.events) - 6} more, then " if len(self.events) > 6 else ""
        plural = "" if self.programs == 1 else "s"
        counts = f"{self.programs} program{plural} compiled"
        if self.loaded:
            counts += f", {self.loaded} loaded"
        return f"{counts} in {self.seconds + self.load_seconds:.1f} s: {more}{what}"


_stats = CompileStats()
# The models (`ModelRunner`s) `ll.precompile` prepared programs for: from then on a new
# program of one of them is a request outside the prepared buckets, and `record` warns,
# naming the dimension (not while `precompile` itself runs). Another model's programs do
# not warn.
_prepared: set = set()
_preparing = False
# program name -> the signatures it compiled for (`signature`), to name what was new.
_seen: dict[str, list[dict[str, Any]]] = {}


def compile_stats(reset: bool = False) -> CompileStats:
    """How many programs logitloop's entry points (`generate`, `stream`, `generate_many`,
    `score`, `token_logprobs`, `beam_search`, `precompile`, ...) compiled in this process,
    how long it took and why each one compiled (`CompileStats.events`: the dimension that
    was new). A copy; `reset=True` starts the count again (the record of shapes seen is
    kept, so reasons stay meaningful).

        ll.generate(model, prompts)
        print(ll.compile_stats().summary())   # "2 programs compiled in 5.1 s: prefill ..."
    """
    global _stats
    out = dataclasses.replace(_stats, events=list(_stats.events))
    if reset:
        _stats = CompileStats()
    return out


def signature(arguments: dict[str, Any]) -> dict[str, Any]:
    """What picks a program among a call's `arguments` (name -> value): each array's shape
    and dtype by its path, each other leaf (a static argument) by its value."""
    out: dict[str, Any] = {}
    for name, value in arguments.items():
        leaves = jax.tree_util.tree_leaves_with_path(value, is_leaf=lambda x: x is None)
        for path, leaf in leaves:
            key = name + jax.tree_util.keystr(path)
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                out[key] = (tuple(leaf.shape), str(leaf.dtype))
            else:
                out[key] = leaf
    return out


def _distance(old: dict[str, Any], new: dict[str, Any]) -> int:
    """How far apart two signatures are: entries present in one only or unequal, a static
    argument (the model, the program) counting as many (a program of the same model is
    the better comparison)."""
    both = old.keys() & new.keys()
    unequal = [k for k in both if not _same(old[k], new[k])]
    static = sum(not _is_shape(new[k]) for k in unequal)
    return len(old.keys() ^ new.keys()) + len(unequal) + 1000 * static


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two signatures, in words."""
    if old.keys() != new.keys():
        gone = {_head(k) for k in old.keys() - new.keys()}
        came = {_head(k) for k in new.keys() - old.keys()}
        return [f"{k} added" for k in sorted(came - gone)] + [
            f"{k} removed" for k in sorted(gone - came)
        ] or [f"{k} changed structure" for k in sorted(came)]
    shapes, others = [], []
    for key in new:
        a, b = old[key], new[key]
        if _is_shape(a) and _is_shape(b):
            if a != b:
                shapes.append((key, a, b))
        elif not _same(a, b):
            others.append(_static_difference(key, a, b))
    rows = collections.Counter(
        (a[0][0], b[0][0]) for _, a, b in shapes if a[0][:1] != b[0][:1] and a[0] and b[0]
    )
    if rows:  # the rows changed (most arrays' first axis): name that once, then what else did
        ((r0, r1), _), *_ = rows.most_common(1)
        others.insert(0, f"rows {r0} -> {r1}")
        shapes = [
            (k, a, b)
            for k, a, b in shapes
            if a[0][:1] != (r0,) or b[0][:1] != (r1,) or a[0][1:] != b[0][1:] or a[1] != b[1]
        ]
    for key, a, b in shapes[:2]:
        others.append(f"{key} {_brief(a)} -> {_brief(b)}")
    if len(shapes) > 2:
        others.append(f"{len(shapes) - 2} more arrays")
    return others


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _static_difference(key: str, a: Any, b: Any) -> str:
    """A static argument's change: for dataclasses (the loop's `Program`, its pool's
    `PoolShape`), the fields that differ, down to plain values."""
    return ", ".join(_field_differences(key.split("[")[0], a, b))


def _field_differences(name: str, a: Any, b: Any) -> list[str]:
    if _is_record(a) and type(a) is type(b):
        fields = [
            f.name
            for f in dataclasses.fields(a)
            if not _same(getattr(a, f.name), getattr(b, f.name))
        ]
        if "runner" in fields:
            return [f"a new model or numerics ({name}.runner)"]
        out = [d for f in fields for d in _field_differences(f"{name}.{f}", *_pair(a, b, f))]
        if out:
            return out
    if _is_record(b) and a is None:
        return [f"{name} added"]
    if _is_record(a) and b is None:
        return [f"{name} removed"]
    return [f"{name} {_brief(a)} -> {_brief(b)}"]


def _is_record(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _pair(a: Any, b: Any, field: str) -> tuple[Any, Any]:
    return getattr(a, field), getattr(b, field)


def _head(key: str) -> str:
    """A signature key's argument and first field: "tables.stops" of
    "tables.stops.strings"."""
    parts = [p for p in re.split(r"[.\[\]']+", key) if p]
    return ".".join(parts[:2])


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays or objects without a plain equality
        return a is b


def _brief(x: Any) -> str:
    if _is_shape(x):
        return f"{x[1]}{list(x[0])}"
    text = repr(x)
    return text if len(text) <= 60 else type(x).__name__


class ProgramLog:
    """The programs logitloop's jitted functions ran while active, as `compile_stats`
    counts them: `runs`, the distinct programs run (a function and its call's
    `signature`), and `compiled`, how many of them compiled (the others this process had
    already). `ll.precompile(slots=...)` reports these for the job it runs."""

    def __init__(self):
        self.runs: set = set()
        self.compiled = 0

    def __enter__(self) -> ProgramLog:
        _logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _logs.remove(self)


_logs: list[ProgramLog] = []


def logging_programs() -> bool:
    """Whether a `ProgramLog` is active (`ran` is then worth calling)."""
    return bool(_logs)


def ran(program: str, sig: dict[str, Any]) -> None:
    """Note that `program` ran for a call of this `signature` (for the active logs)."""
    key = (program, tuple(sorted((k, v if _is_shape(v) else repr(v)) for k, v in sig.items())))
    for log in _logs:
        log.runs.add(key)


class preparing:  # noqa: N801 - a context manager, used like a function
    """While active (`ll.precompile`), new programs are the prepared buckets and their
    models are marked prepared; afterwards a new program of such a model warns."""

    def __enter__(self):
        global _preparing
        _preparing = True

    def __exit__(self, *exc):
        global _preparing
        _preparing = False


def record(
    program: str, seconds: float, sig: dict[str, Any], model: Any = None, loaded: bool = False
) -> CompileEvent:
    """Count one program `program` compiled (`loaded`: read from the executable store) for
    the call whose `signature` is `sig`, naming what was new against the closest signature
    it compiled for before. `model` (hashable: the call's `ModelRunner`): while
    `precompile` runs, it is marked prepared; afterwards a new program of a prepared model
    warns."""
    seen = _seen.setdefault(program, [])
    if not seen:
        reason = "the first program of its kind"
    else:
        closest = min(reversed(seen), key=lambda old: _distance(old, sig))  # newest of ties
        diffs = _differences(closest, sig)
        reason = ", ".join(diffs) if diffs else "the same shapes (the jit cache was cleared)"
    seen.append(sig)
    del seen[:-64]  # the newest 64 are enough to name a difference
    event = CompileEvent(program, seconds, reason, loaded)
    if _preparing and model is not None:
        _prepared.add(model)
    elif model is not None and model in _prepared:
        warnings.warn(
            f"logitloop: {program} {'loaded' if loaded else 'compiled'} a new program "
            f"({reason}), outside the buckets "
            "ll.precompile prepared",
            stacklevel=4,
        )
    if loaded:
        _stats.loaded += 1
        _stats.load_seconds += seconds
    else:
        _stats.programs += 1
        _stats.seconds += seconds
        for log in _logs:
            log.compiled += 1
    _stats.events.append(event)
    del _stats.events[:-1000]
    return event
