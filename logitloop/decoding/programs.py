"""Traced programs kept between processes (`jax.export`), so that a second run with the same
shapes skips tracing and lowering, as the persistent compilation cache skips XLA's compile.

`stored_jit(static_argnames=..., donate_argnames=...)` is `jax.jit` for the device loop's
host-level entry points (`loop.decode`, `batching._admit`, `batching._empty_state`). While
no store is set (the default: the library writes nothing anywhere) a call is exactly the
jitted function's call. `use_program_store(folder)` (the CLI, beside its compilation cache)
makes a call look its program up by a key of everything the program depends on:

- the function (module and name) and its static arguments (the model's `GraphDef` by its
  text, object addresses left out: the model's configuration and layer types, not its
  tokenizer object),
- the tree structure, shapes, dtypes and weak types of the array arguments,
- the source of the logitloop package (a hash of every `.py` file), and the versions of
  jax, jaxlib and flax, and the backend and device kind.

A program found is `jax.export.deserialize`d and called through `jax.jit(exported.call)`
(whose lowering only embeds the stored module, so the compilation cache finds its
executable); a program not found, or a file that cannot be read back, is traced as usual,
exported, written (atomically) and called the same way. The exported module is the one
`jax.jit` would lower, so the tokens are the same. Calls on a mesh (a layout with a mesh),
calls with a plain-function model (`FunctionModel`: its functions have no stable name) and
calls from inside another trace go straight to `jax.jit`.
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

_store: Path | None = None
_loaded: dict[str, Callable] = {}  # key -> jax.jit(exported.call), for this process
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def use_program_store(folder: str | os.PathLike | None) -> None:
    """Keep traced programs in `folder` (None: keep none, every call is plain `jax.jit`)."""
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
            leaves, _ = jax.tree.flatten(tuple(dynamic.values()))
            out_tree, run = program
            return jax.tree.unflatten(out_tree, run(*leaves))

        call.trace = jitted.trace
        call.jitted = jitted
        return call

    return wrap


def _storable(static: dict[str, Any], leaves: list[Any]) -> bool:
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return False  # inside another trace: part of that program
    layout = static.get("layout")
    if layout is not None and getattr(layout, "mesh", None) is not None:
        return False
    runner = static.get("runner")
    if runner is not None and getattr(runner, "deterministic", False):
        return False  # compiled with its own options (`runner_jit`), which export drops
    return runner is None or getattr(runner, "graphdef", None) is not None


def _program(fn, static, dynamic, donate_argnames) -> tuple[Any, Callable] | None:
    """(out_tree, callable of the flat leaves) for this call, or None: use plain jit."""
    leaves, in_tree = jax.tree.flatten(tuple(dynamic.values()))
    if not _storable(static, leaves):
        return None
    avals = [jax.typeof(x) for x in leaves]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    key = _key(fn, static, in_tree, avals)
    if key in _loaded:
        return _loaded[key]
    # The flat leaves of the donated arguments, in the order of the dynamic arguments.
    donated, start = [], 0
    for name, value in dynamic.items():
        count = len(jax.tree.leaves(value))
        if name in donate_argnames:
            donated.extend(range(start, start + count))
        start += count
    path = _store / f"{key}.program"
    program = _read(path)
    if program is None:
        out_trees = []

        def flat(*xs):
            out = fn(**dict(zip(dynamic, jax.tree.unflatten(in_tree, xs), strict=True)), **static)
            out_leaves, out_tree = jax.tree.flatten(out)
            out_trees.append(out_tree)
            return out_leaves

        exported = jax.export.export(jax.jit(flat))(*structs)
        program = (out_trees[0], exported)
        if not _write(path, out_trees[0], exported):
            use_program_store(None)  # cannot serialize or write: plain jit from now on
    out_tree, exported = program
    entry = (out_tree, jax.jit(exported.call, donate_argnums=tuple(donated)))
    _loaded[key] = entry
    return entry


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
        device.device_kind,
    )


def _read(path: Path) -> tuple[Any, Any] | None:
    """(out_tree, Exported) from a program file, or None when it is absent or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        out_tree, serialized = pickle.loads(data)
        return out_tree, jax.export.deserialize(bytearray(serialized))
    except Exception:  # a truncated, corrupt or foreign file: trace again and replace it
        return None


def _write(path: Path, out_tree: Any, exported: Any) -> bool:
    """Write a program file in one piece (a temporary file renamed into place); False when
    it cannot be (no `flatbuffers`, an unwritable folder): the program runs all the same."""
    tmp = None
    try:
        data = pickle.dumps((out_tree, bytes(exported.serialize())))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".program")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except (ImportError, OSError, pickle.PicklingError, TypeError, ValueError):
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
