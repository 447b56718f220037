"""Compiled programs kept between processes, so that a second run with the same shapes
neither traces, lowers nor compiles the decode loop again.

`stored_jit(static_argnames=..., donate_argnames=...)` is `jax.jit` for the device loop's
host-level entry points (`loop.decode`, `batching._admit`, `batching._empty_state`). While
no store is set (the default: the library writes nothing anywhere) a call is exactly the
jitted function's call. `use_program_store(folder)` (the CLI, beside its compilation cache)
makes a call look its program up by a key of everything the program depends on:

- the function (module and name) and its static arguments (the model's `GraphDef` by its
  text, object addresses left out: the model's configuration and layer types, not its
  tokenizer object),
- the tree structure, shapes, dtypes and weak types of the array arguments,
- the source of the logitloop package (a hash of every `.py` file), the versions of jax,
  jaxlib and flax, the backend, its version and the device kind, and `XLA_FLAGS`.

A program found is loaded as XLA's serialized executable
(`jax.experimental.serialize_executable`, the format JAX's own persistent compilation cache
keeps) and called with the argument leaves; a program not found, or a file that cannot be
read back, is traced, lowered and compiled as `jax.jit` would (the same module, so the same
tokens), written (atomically) and called the same way. Calls on a mesh (a layout with a
mesh), calls with a plain-function model (`FunctionModel`: its functions have no stable
name) and calls from inside another trace go straight to `jax.jit`.

(An earlier version stored `jax.export` modules; calling one still lowered a wrapper and
initialized LAPACK's custom calls, about 0.4 s of a 3 s second run.)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

_store: Path | None = None
_loaded: dict[str, Callable] = {}  # key -> compiled program, for this process
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def use_program_store(folder: str | os.PathLike | None) -> None:
    """Keep compiled programs in `folder` (None: keep none, every call is plain `jax.jit`)."""
    global _store
    _store = None if folder is None else Path(folder)
    _loaded.clear()


def program_store() -> Path | None:
    return _store


def stored_jit(
    *,
    static_argnames: Sequence[str] = (),
    donate_argnames: Sequence[str] = (),
    jit: Callable = jax.jit,
) -> Callable[[Callable], Callable]:
    """`jit(fn, static_argnames=..., donate_argnames=...)` (`jax.jit`, or a wrapper of it
    such as `decoding.model.runner_jit`), whose programs go through the store when one is
    set (see the module docstring). `.trace` is the jitted function's."""

    def wrap(fn: Callable) -> Callable:
        jitted = jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _store is None:
                return jitted(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            static = {k: v for k, v in bound.arguments.items() if k in static_argnames}
            dynamic = {k: v for k, v in bound.arguments.items() if k not in static_argnames}
            program = _program(fn, static, dynamic, donate_argnames)
            if program is None:
                return jitted(*args, **kwargs)
            return program(*jax.tree.leaves(tuple(dynamic.values())))

        call.trace = jitted.trace
        call.jitted = jitted
        return call

    return wrap


def _storable(static: dict[str, Any], leaves: list[Any]) -> bool:
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return False  # inside another trace: part of that program
    program = static.get("program")  # the loop's `Program`, or a runner and layout
    layout = static.get("layout", getattr(program, "layout", None))
    if layout is not None and getattr(layout, "mesh", None) is not None:
        return False
    runner = static.get("runner", getattr(program, "runner", None))
    if runner is not None and getattr(runner, "deterministic", False):
        return False  # compiled with its own options (`runner_jit`), not stored
    return runner is None or getattr(runner, "graphdef", None) is not None


def _program(fn, static, dynamic, donate_argnames) -> Callable | None:
    """The compiled program for this call (a callable of the flat leaves that returns the
    output tree), or None: use plain jit."""
    leaves, in_tree = jax.tree.flatten(tuple(dynamic.values()))
    if not _storable(static, leaves):
        return None
    avals = [jax.typeof(x) for x in leaves]
    key = _key(fn, static, in_tree, avals)
    if key in _loaded:
        return _loaded[key]
    path = _store / f"{key}.executable"
    compiled = _read(path)
    if compiled is None:
        compiled = _compile(fn, static, dynamic, in_tree, avals, donate_argnames)
        if not _write(path, compiled):
            use_program_store(None)  # cannot serialize or write: plain jit from now on
    _loaded[key] = compiled
    return compiled


def _compile(fn, static, dynamic, in_tree, avals, donate_argnames) -> Any:
    """Trace, lower and compile `fn` as a function of the flat leaves of its dynamic
    arguments (the static ones fixed), donating the leaves of `donate_argnames`."""
    donated, start = [], 0
    for name, value in dynamic.items():
        count = len(jax.tree.leaves(value))
        if name in donate_argnames:
            donated.extend(range(start, start + count))
        start += count

    def flat(*xs):
        return fn(**dict(zip(dynamic, jax.tree.unflatten(in_tree, xs), strict=True)), **static)

    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.jit(flat, donate_argnums=tuple(donated)).lower(*structs).compile()


def _key(fn, static, in_tree, avals) -> str:
    described = {
        name: _ADDRESS.sub("", repr(getattr(v, "graphdef", v))) for name, v in static.items()
    }
    text = repr(
        (
            _environment(),
            f"{fn.__module__}.{fn.__qualname__}",
            sorted(described.items()),
            str(in_tree),
            [(a.shape, str(a.dtype), a.weak_type) for a in avals],
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@functools.cache
def _environment() -> tuple[str, ...]:
    """What every program depends on besides its arguments: logitloop's source, the
    libraries' versions, the backend."""
    import flax
    import jaxlib

    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode())
        source.update(path.read_bytes())
    device = jax.devices()[0]
    return (
        source.hexdigest(),
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        device.platform,
        device.client.platform_version,
        device.device_kind,
        os.environ.get("XLA_FLAGS", ""),
    )


def _read(path: Path) -> Any | None:
    """The compiled program in a program file, or None when it is absent or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        payload, in_tree, out_tree = pickle.loads(data)
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # a truncated, corrupt or foreign file: compile again and replace it
        return None


def _write(path: Path, compiled: Any) -> bool:
    """Write a program file in one piece (a temporary file renamed into place); False when
    it cannot be (a program XLA cannot serialize, an unwritable folder): the program runs
    all the same."""
    tmp = None
    try:
        data = pickle.dumps(serialize_executable.serialize(compiled))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".executable")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except (NotImplementedError, OSError, pickle.PicklingError, TypeError, ValueError):
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
