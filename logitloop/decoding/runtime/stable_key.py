"""Keys that are the same in every process: values described as data, and what a process
shares with every program it compiles (versions, source, backend, settings), for the store
of executables (`executables`).

`describe(x)` turns a static argument (a model's graph and config, the loop's `Program`)
into JSON: types and functions by qualified name, and only those of logitloop (whose
source is hashed into every key) and the libraries whose versions are (flax, jax, numpy);
anything else (a user's function or module class, a mesh, an object with no dataclass
fields) raises `Unstable`, and its program stays out of the store. `describe_tree` and
`rebuild_tree` do the same for a pytree's structure, rebuilding it from classes already
imported, with no module imported and no code from the description run.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import pathlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

FORMAT = 1  # the entries' format: part of every key

_TRUSTED = ("logitloop", "flax", "jax", "jaxlib", "numpy", "ml_dtypes", "builtins", "pathlib")
# Described by their class alone: a family model keeps its tokenizer as a static attribute
# of its graph, which its forward pass never reads.
_BY_TYPE = ("logitloop.models.tokenizer:Tokenizer",)


class Unstable(Exception):
    """A value that has no description stable across processes."""


# ------------------------------------------------------------------------ describing values


def _trusted(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in _TRUSTED


def name_of(obj: Any) -> str:
    """`module:qualname` of a class or function of a trusted module (logitloop's code is
    hashed into the key, the libraries' by their versions), else Unstable."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not _trusted(module) or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise Unstable(f"{obj!r} is not a module-level name of logitloop or its libraries")
    return f"{module}:{qualname}"


def describe(x: Any, depth: int = 0) -> Any:
    """A JSON-able description of a static argument that is the same in every process
    (same versions) for equal values, or Unstable."""
    if depth > 60:
        raise Unstable("too deeply nested")
    d = depth + 1
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)) and type(x) in (int, float):
        return [type(x).__name__, repr(x)]
    if isinstance(x, enum.Enum):
        return ["enum", name_of(type(x)), x.name]
    if isinstance(x, (np.dtype, np.generic)):
        return ["np", type(x).__name__, str(x)]
    if isinstance(x, pathlib.PurePath):
        return ["path", str(x)]
    if isinstance(x, type) or inspect.isfunction(x) or inspect.isbuiltin(x):
        return ["name", name_of(x)]
    if isinstance(x, functools.partial):
        return ["partial", describe(x.func, d), describe(x.args, d), describe(x.keywords, d)]
    if isinstance(x, jax.tree_util.PyTreeDef):
        return ["tree", describe_tree(x)]
    if isinstance(x, (tuple, list)) and type(x) in (tuple, list):
        return [type(x).__name__, [describe(v, d) for v in x]]
    if isinstance(x, (set, frozenset)):
        return ["set", sorted(json.dumps(describe(v, d), sort_keys=True) for v in x)]
    kind = name_of(type(x))
    if kind in _BY_TYPE:
        return ["instance", kind]
    if isinstance(x, Mapping):
        items = sorted((json.dumps(describe(k, d)), describe(v, d)) for k, v in x.items())
        return ["map", kind, items]
    if dataclasses.is_dataclass(x):
        fields = [(f.name, describe(getattr(x, f.name), d)) for f in dataclasses.fields(x)]
        return ["dataclass", kind, fields]
    if isinstance(x, tuple):  # a NamedTuple
        return ["tuple", kind, [describe(v, d) for v in x]]
    raise Unstable(f"no stable description of {type(x).__name__}")


def describe_tree(tree: jax.tree_util.PyTreeDef) -> Any:
    """A JSON description of a pytree's structure (`rebuild_tree` reads it back): leaves as
    null, nodes as [class, aux data, children]."""
    data = tree.node_data()
    if data is None:
        return None
    kind, aux = data
    return [name_of(kind), describe(aux), [describe_tree(c) for c in tree.children()]]


def rebuild_tree(desc: Any) -> jax.tree_util.PyTreeDef:
    """The pytree structure `describe_tree` described, from classes already imported (no
    module is imported, no code from the entry runs); ValueError where it cannot be."""
    if desc is None:
        return jax.tree.structure(0)
    name, aux, children = desc
    kind = _lookup(name)
    node = (kind, _undescribe(aux))
    kids = [rebuild_tree(c) for c in children]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, node, kids
    )


def _lookup(name: str) -> Any:
    if name == "builtins:NoneType":
        return type(None)
    module, _, qualname = name.partition(":")
    if not _trusted(module) or module not in sys.modules:
        raise ValueError(f"the entry names {name}, not a loaded class of logitloop or a library")
    obj = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _undescribe(desc: Any) -> Any:
    """The value of a pytree node's aux data from `describe` (the kinds a node's aux data
    takes: constants, tuples, lists, names)."""
    if desc is None or isinstance(desc, (bool, str)):
        return desc
    tag, *rest = desc
    if tag in ("int", "float"):
        return {"int": int, "float": float}[tag](rest[0])
    if tag in ("tuple", "list") and len(rest) == 1:
        values = [_undescribe(v) for v in rest[0]]
        return tuple(values) if tag == "tuple" else values
    if tag == "name":
        return _lookup(rest[0])
    if tag == "enum":
        return getattr(_lookup(rest[0]), rest[1])
    raise ValueError(f"the entry holds aux data of kind {tag!r}, which it cannot read back")


# ------------------------------------------------------------------------------ the process


@functools.cache
def environment() -> dict[str, Any]:
    """What every key shares in this process: versions, source hash, backend, settings."""
    from importlib import metadata

    import flax
    import jaxlib

    try:  # the package's metadata, not the package: logitloop imports this module
        version = metadata.version("logitloop")
    except metadata.PackageNotFoundError:  # a source tree on the path (the hash rules)
        version = "source"
    device = jax.devices()[0]
    return {
        "format": FORMAT,
        "logitloop": version,
        "source": source_hash(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "platform": device.platform,
        "platform_version": device.client.platform_version,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


@functools.cache
def source_hash() -> str:
    """sha256 over logitloop's Python files (their paths and bytes): a change to the code
    never loads a program traced from the old code."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def trace_settings() -> Any:
    """JAX's settings that change a trace (`jax._src.config.trace_context`, which jit keys
    its own cache on), the constant ones by value."""
    from jax._src import config

    out = []
    for value in config.trace_context():
        try:
            out.append(describe(value))
        except Unstable:
            out.append(["type", type(value).__qualname__])
    return out
