"""A store of compiled executables, so that a warm process loads its programs without tracing
or lowering them again.

JAX's persistent compilation cache (`logitloop.compile_cache`) saves the XLA compile only:
its key is the lowered program, so a process still traces and lowers every program before
the cache can answer (about 0.8 s a program for the shipped model's `generate`). This store
keys a program by what logitloop knows before tracing, and keeps the executable XLA
compiled with what JAX needs to call it:

- the key (`Call.description`): logitloop's version and a hash of its source files, the
  jax, jaxlib and flax versions, the backend, its version and device kind, `XLA_FLAGS`
  and JAX's trace-time settings; the jitted function's qualified name, its jit options and
  compiler options; each static argument described as data (the model's graph, config,
  dtype and numerics, the loop's `Program`: types by qualified name, values by value); the
  call's tree and each array's shape, dtype, weak type and device. A static argument that
  cannot be described so (a user's function or module class, a mesh: anything whose
  meaning is not fixed by logitloop's and its libraries' versions) keeps the program out
  of the store: it is traced as before.
- an entry (`<sha256 of the key>.xla` in `<compile cache folder>/executables`): a JSON
  header (the key itself, the avals, shardings, layouts and kept inputs of the executable,
  its output tree, the executable's size and sha256) and the bytes of
  `client.serialize_executable`. Loading reads the JSON, checks that the key is this
  call's and the hash the bytes', and hands the bytes to XLA
  (`client.deserialize_executable`); nothing is unpickled or run as Python. The output tree
  is rebuilt from already imported pytree classes named in the header (logitloop's, flax's
  and jax's only).

An entry that cannot be used (truncated, corrupt, another key's: another jax version or
another model) is refused with a warning, the program compiled again and the entry
replaced. A write goes to a temporary file in the same folder, then `os.replace`, so a
process killed while writing leaves no entry half written. A folder that cannot be written
(read-only, full) warns once and keeps nothing more in this process; a run never fails
because of the store. Only single-device programs are kept (every input and output on one
device, no host callbacks nor effects).

A program for the store is compiled by XLA in this process, JAX's persistent cache bypassed,
and serialized before it first runs: XLA:CPU cannot serialize an executable that ran ("`...`
is not serializable"), and the copy of one JAX loaded from its cache lacks its kernels
("Function ... not found" when it runs; the earlier store, removed in 2026-12, wrote such
entries). A process that loaded program A then B leaves `A.next` (B's digest): the next
process that loads A reads and deserializes B on a thread meanwhile (XLA releases the GIL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from logitloop.decoding.runtime.stable_key import (
    Unstable,
    describe,
    describe_tree,
    environment,
    name_of,
    rebuild_tree,
    trace_settings,
)

MAGIC = b"logitloop-executable 1\n"
FOLDER = "executables"
# ------------------------------------------------------------------------------- the store


class _Memory:
    """The executables this process loaded or compiled through the store, by call key;
    cleared by `jax.clear_caches()` like JAX's own (hashed by identity, as JAX's registry
    of caches needs)."""

    def __init__(self):
        self.entries: dict[tuple, Any] = {}

    def cache_clear(self):
        self.entries.clear()

    def cache_info(self):
        return len(self.entries)

    def cache_keys(self):
        return list(self.entries)


_memory = _Memory()
try:
    from jax._src import util as _jax_util

    _jax_util.register_cache(_memory, "logitloop executables")
except (ImportError, AttributeError):  # pragma: no cover - another jax: not cleared then
    pass

_unwritable: set[str] = set()  # folders that failed a write: warned once, no more writes
_unserializable: set[str] = set()  # kinds of error met serializing: warned once each


def folder() -> Path | None:
    """The store's folder: `executables` in the compile cache folder logitloop enabled
    (`ll.enable_compile_cache`, the CLI's default), None while none is."""
    from logitloop import compile_cache

    cache = compile_cache.active()
    return None if cache is None else cache.folder / FOLDER


@dataclasses.dataclass
class Call:
    """One call of a `runner_jit` function as the store sees it: the arguments split into
    static and dynamic ones (in the form the program is traced and called with), the
    in-process key and, built on demand, the key written to disk."""

    jitted: Any  # the jax.jit function picked for the call
    fn: Any  # the Python function
    static: dict[str, Any]
    args: tuple  # dynamic positional arguments
    kwargs: dict[str, Any]  # dynamic keyword arguments
    traced_args: tuple  # the call as traced: statics included
    traced_kwargs: dict[str, Any]
    names: tuple  # the dynamic positional arguments' names
    donated: frozenset
    options: tuple
    jit_kwargs: dict[str, Any]
    tree: Any
    leaves: tuple
    committed: bool  # whether the outputs are committed to their device (not in the key)
    memory_key: _Key

    @functools.cached_property
    def description(self) -> dict[str, Any]:
        """The key on disk (raises Unstable where a static argument has no description)."""
        static = {name: describe(v) for name, v in sorted(self.static.items())}
        return json.loads(
            json.dumps(
                {
                    "environment": environment(),
                    "trace_settings": trace_settings(),
                    "function": name_of(self.fn),
                    "jit": describe(self.jit_kwargs),
                    "compiler_options": describe(self.options),
                    "static": static,
                    "tree": describe_tree(self.tree),
                    "leaves": [list(leaf) for leaf in self.leaves],
                },
                sort_keys=True,
            )
        )

    @functools.cached_property
    def digest(self) -> str:
        text = json.dumps(self.description, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def run(self, compiled: Any) -> Any:
        return compiled(*self.args, **self.kwargs)

    def compile(self) -> Any:
        """Trace, lower and compile the program (a `jax.stages.Compiled`), by XLA itself:
        JAX's persistent cache is not read, because an executable JAX loaded from it
        cannot be serialized again (on XLA:CPU the copy lacks its kernels: "Function ...
        not found" when it runs), and not written either, the store holding the program."""
        lowered = self.jitted.trace(*self.traced_args, **self.traced_kwargs).lower()
        with _without_persistent_cache() as self.bypassed:
            return lowered.compile()

    bypassed = False  # whether `compile` kept JAX's persistent cache out (False: `save` skips)


@contextlib.contextmanager
def _without_persistent_cache():
    """JAX's persistent compilation cache off while active (its switch latched for the
    process, `compilation_cache.is_cache_used`, set to off and back); yields whether it
    could be (False where this jax keeps the switch elsewhere)."""
    from jax._src import compilation_cache as cc

    if not all(hasattr(cc, n) for n in ("_cache_initialized_mutex", "_cache_checked")):
        yield False
        return
    with cc._cache_initialized_mutex:
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield True
    finally:
        with cc._cache_initialized_mutex:
            cc._cache_checked, cc._cache_used = saved


def _leaf(x: Any) -> tuple:
    """(shape, dtype, weak type, where) of one dynamic leaf, an array or its
    `jax.ShapeDtypeStruct` alike (`precompile`'s); Unstable off one device."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        aval, sharding = x.aval, x.sharding
    else:
        from jax._src import core

        aval, sharding = core.shaped_abstractify(x), getattr(x, "sharding", None)
    if sharding is None:  # host values and unplaced structs: jit puts them there
        where = _default_place()
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        where = (device.id, sharding.memory_kind)
    else:
        raise Unstable("an argument lies over several devices")
    return (aval.shape, aval.dtype.name, aval.weak_type, where)


@functools.cache
def _default_place() -> tuple:
    device = jax.devices()[0]
    return (device.id, jax.sharding.SingleDeviceSharding(device).memory_kind)


def _committed(flat: list) -> bool:
    """Whether jit would make the call's outputs committed to their device: an argument is
    (a committed array, or a `ShapeDtypeStruct` with a sharding)."""
    for x in flat:
        if isinstance(x, jax.Array) and getattr(x, "_committed", True):
            return True
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
            return True
    return False


def prepare(
    jitted: Any, fn: Any, jit_kwargs: dict[str, Any], options: tuple, args: tuple, kwargs: dict
) -> Call | None:
    """The store's view of a call (`args` with the runner first), or None where the store
    does not take part: none is enabled, or the call's arguments lie over several devices
    or cannot be keyed (a value jit would refuse too: jit reports it)."""
    if folder() is None:
        return None
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    statics = set(jit_kwargs.get("static_argnames", ()))
    donated = set(jit_kwargs.get("donate_argnames", ()))
    names = list(bound.arguments)
    positional = [(n, a) for n, a in zip(names, bound.args, strict=False) if n not in statics]
    dyn_args = tuple(a for _, a in positional)
    dyn_kwargs = {n: a for n, a in bound.kwargs.items() if n not in statics}
    static = {n: bound.arguments[n] for n in names if n in statics}
    flat, tree = jax.tree.flatten((dyn_args, dyn_kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in flat):
        return None  # inside another program: part of its trace
    try:
        leaves = tuple(_leaf(x) for x in flat)
        committed = _committed(flat)
        memory_key = _Key((jitted, tuple(sorted(static.items())), tree, leaves))
    except (Unstable, TypeError):
        return None
    return Call(
        jitted, fn, static, dyn_args, dyn_kwargs, bound.args, bound.kwargs,
        tuple(n for n, _ in positional), frozenset(n for n in names if n in donated), options,
        jit_kwargs, tree, leaves, committed, memory_key,
    )  # fmt: skip


class _Key:
    """An in-process key hashed once (a model's graph is slow to hash)."""

    __slots__ = ("hash", "value")

    def __init__(self, value: tuple):
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.value == other.value


@functools.cache
def _signature(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def remembered(call: Call) -> Any | None:
    """The executable this process has for the call already (None: none); one it has for
    arguments committed otherwise (`precompile`'s structs, then arrays) serves too, its
    outputs committed as this call's are."""
    exact = _memory.entries.get((call.memory_key, call.committed))
    if exact is not None:
        return exact
    other = _memory.entries.get((call.memory_key, not call.committed))
    if other is None:
        return None
    from jax._src import stages

    unloaded = other._executable._unloaded_executable
    unloaded = dataclasses.replace(unloaded, committed=call.committed)
    variant = stages.Compiled(unloaded.load(), [], other.args_info, other.out_tree)
    _remember(call, variant)
    return variant


def _remember(call: Call, compiled: Any) -> None:
    _memory.entries[(call.memory_key, call.committed)] = compiled


def load(call: Call) -> Any | None:
    """The call's executable from disk (a `jax.stages.Compiled`), or None: no entry, the
    call has no stable key, or the entry was refused (with a warning)."""
    place = folder()
    try:
        path = place / f"{call.digest}.xla"
    except Unstable:
        return None
    compiled = _prefetched_for(call)
    if compiled is None:
        try:
            body = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            _warn(f"executable {path} not read ({e.strerror or e}); compiling it again")
            return None
        try:
            compiled = _decode(call, body)
        except Exception as e:  # anything wrong with the entry: compile again, replace it
            _warn(f"executable {path} not used ({e}); compiling it again")
            return None
    _remember(call, compiled)
    _follow(call.digest, place)
    return compiled


def save(call: Call, compiled: Any, fresh: bool) -> None:
    """Keep `compiled` (this call's executable) in memory and, when XLA compiled it just
    now (`fresh`: not an executable this process had or loaded), it can be described
    and the folder written, on disk."""
    _remember(call, compiled)
    place = folder()
    if not (fresh and call.bypassed) or place is None or str(place) in _unwritable:
        return
    try:
        body = _encode(call, compiled)
    except (Unstable, NotSupported):
        return  # a program the store does not keep: traced in every process
    except Exception as e:  # XLA cannot serialize it, or this jax's internals differ
        if type(e).__name__ not in _unserializable:
            _unserializable.add(type(e).__name__)
            _warn(f"a program is not kept in the executable store ({e}); it compiles as usual")
        return
    if _write(place, f"{call.digest}.xla", body):
        _follow(call.digest, place)


def _write(place: Path, name: str, body: bytes) -> bool:
    """Write `place / name` whole or not at all (a temporary file in the same folder, then
    `os.replace`); a folder that cannot be written warns once and takes no more."""
    if str(place) in _unwritable:
        return False
    from logitloop import compile_cache

    tmp = place / f".{name}.{os.getpid()}.tmp"
    try:
        refused = compile_cache.unsafe_folder(place)
        if refused is not None:
            raise OSError(refused)
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, place / name)
        return True
    except OSError as e:
        _unwritable.add(str(place))
        _warn(
            f"executables are not kept in {place} in this process "
            f"({e.strerror or e}); programs compile as usual"
        )
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


# ---------------------------------------------------------------- loading the next program
# A process that loads program A and then B wrote `A.next` (B's digest); the next process
# that loads A starts reading and deserializing B on a thread (XLA releases the GIL), so
# that B is ready or nearly when its call comes. Only B's call, its key checked as always,
# ever uses what was read.

_last: list[str] = []  # the digest of the program this process got last
_prefetched: dict[str, dict] = {}  # digest -> {"thread", "result"} of a read under way
_session: list[str] = []  # `read_ahead`'s name: the first program is noted under it


def read_ahead(name: str) -> None:
    """Start reading, on threads, the program the last process that called `read_ahead`
    with this `name` got first, and the one that followed it (the CLI: "cli-generate", as
    it enables its cache, so the programs deserialize while the model loads)."""
    place = folder()
    if place is None or not name.replace("-", "").isalnum():
        return
    _session[:] = [name]
    first = _link(place / f"{name}.first")
    if first is not None:
        _read_following(place, first)


def _link(path: Path) -> str | None:
    """The digest a link file names (None: no such file, or not a digest)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        return None
    return text


def _note(path: Path, digest: str) -> None:
    if _link(path) != digest:
        _write(path.parent, path.name, digest.encode())


def _follow(digest: str, place: Path) -> None:
    """Note that `digest` came after the previous program (or first, in a `read_ahead`
    session), and start reading the one that came after it last time."""
    previous = _last[0] if _last else None
    _last[:] = [digest]
    if previous is None and _session:
        _note(place / f"{_session[0]}.first", digest)
    elif previous is not None and previous != digest:
        _note(place / f"{previous}.next", digest)
    following = _link(place / f"{digest}.next")
    if following is not None and following not in _prefetched:
        _start_reading(place / f"{following}.xla", following)


def _read_following(place: Path, digest: str) -> None:
    """Start reading `digest` and the program that followed it."""
    for one in (digest, _link(place / f"{digest}.next")):
        if one is not None and one not in _prefetched:
            _start_reading(place / f"{one}.xla", one)


def _start_reading(path: Path, digest: str) -> None:
    environment()  # computed here, not on the thread
    job: dict[str, Any] = {}

    def read():
        try:
            header, blob = _parse(path.read_bytes())
            if header["key"]["environment"] == environment():
                _check_hash(header, blob)
                job["result"] = (header, *_deserialize(header, blob))
        except Exception:  # the call's own load reads it again and says what is wrong
            pass

    job["thread"] = threading.Thread(target=read, daemon=True, name="logitloop-prefetch")
    _prefetched[digest] = job
    job["thread"].start()


def _prefetched_for(call: Call) -> Any | None:
    """The call's executable from a read started ahead (None: none, or not this call's)."""
    job = _prefetched.pop(call.digest, None)
    if job is None:
        return None
    job["thread"].join()
    if "result" not in job:
        return None
    header, fields, executable = job["result"]
    if header["key"] != call.description:
        return None
    return _assemble(call, header, fields, executable)


def _warn(message: str) -> None:
    warnings.warn(f"logitloop: {message}", stacklevel=4)


# ------------------------------------------------------------------------ entries, in bytes


class NotSupported(Exception):
    """A compiled program the store cannot write faithfully."""


def _encode(call: Call, compiled: Any) -> bytes:
    """An entry: MAGIC, the header's length (8 bytes), the JSON header, the executable."""
    from jax._src.interpreters import pxla

    description = call.description
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if not isinstance(unloaded, pxla.UnloadedMeshExecutable) or compiled._params.const_args:
        raise NotSupported("not a plain mesh executable")
    if unloaded.ordered_effects or unloaded.unordered_effects or unloaded.host_callbacks:
        raise NotSupported("effects or host callbacks")
    if unloaded.keepalive or unloaded.mut is not None or unloaded.pgle_profiler is not None:
        raise NotSupported("state kept alive beside the executable")
    devices = [d.id for d in unloaded.device_list]
    if len(devices) != 1:
        raise NotSupported("several devices")
    meta = {
        "name": unloaded.name,
        "devices": devices,
        "committed": bool(unloaded.committed),
        "kept": sorted(unloaded.kept_var_idx),
        "in_avals": [_aval(a) for a in unloaded.input_avals],
        "out_avals": [_aval(a) for a in unloaded.output_avals],
        "all_in_avals": [_aval(a) for a in unloaded.all_args_info.in_avals],
        "in_shardings": [_sharding(s) for s in unloaded.input_shardings],
        "out_shardings": [_sharding(s) for s in unloaded.output_shardings],
        "xla_in_layouts": [_layout(v) for v in unloaded.xla_in_layouts],
        "dispatch_in_layouts": [_layout(v) for v in unloaded.dispatch_in_layouts],
        "xla_out_layouts": [_layout(v) for v in unloaded.xla_out_layouts],
        "out_tree": describe_tree(compiled.out_tree),
    }
    # Read back what was written, as a load would: a field this format does not hold
    # faithfully keeps the program out of the store rather than writing a wrong entry.
    again = _fields(json.loads(json.dumps(meta)), unloaded.backend)
    for name, value in again.items():
        if name in ("device_list", "all_args_info"):
            value, want = getattr(value, "in_avals", value), unloaded.all_args_info.in_avals
            if name == "device_list":
                value, want = list(value), list(unloaded.device_list)
        else:
            want = getattr(unloaded, name)
        if value != want:
            raise NotSupported(f"{name} does not read back")
    if rebuild_tree(meta["out_tree"]) != compiled.out_tree:
        raise NotSupported("the output tree does not read back")
    blob = unloaded.backend.serialize_executable(unloaded.xla_executable)
    header = {
        "key": description,
        "meta": meta,
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    text = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(text).to_bytes(8, "little") + text + blob


def _decode(call: Call, body: bytes) -> Any:
    """The `jax.stages.Compiled` of an entry, checked against the call; ValueError (or
    another error from a malformed header) where it is not this call's."""
    header, blob = _parse(body)
    if header["key"] != call.description:
        raise ValueError(f"written for another program: {_difference(header['key'], call)}")
    _check_hash(header, blob)
    return _assemble(call, header, *_deserialize(header, blob))


def _parse(body: bytes) -> tuple[dict, bytes]:
    """An entry's header (JSON) and executable bytes."""
    if not body.startswith(MAGIC):
        raise ValueError("not an executable entry of this format")
    start = len(MAGIC) + 8
    length = int.from_bytes(body[len(MAGIC) : start], "little")
    if len(body) < start + length:
        raise ValueError("truncated")
    return json.loads(body[start : start + length]), body[start + length :]


def _check_hash(header: dict, blob: bytes) -> None:
    if len(blob) != header["size"] or hashlib.sha256(blob).hexdigest() != header["sha256"]:
        raise ValueError("truncated or corrupt (its executable does not match its hash)")


def _deserialize(header: dict, blob: bytes) -> tuple[dict, Any]:
    """The executable's fields and XLA's executable, from an entry checked already."""
    backend = jax.devices()[0].client
    fields = _fields(header["meta"], backend)
    executable = backend.deserialize_executable(blob, executable_devices=fields["device_list"])
    return fields, executable


def _assemble(call: Call, header: dict, fields: dict, executable: Any) -> Any:
    """The `jax.stages.Compiled` that runs `executable` for `call`'s arguments."""
    from jax._src import core, stages
    from jax._src.interpreters import pxla

    fields = dict(fields, committed=call.committed)
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=executable, backend=jax.devices()[0].client, unordered_effects=[],
        ordered_effects=[], keepalive=[], host_callbacks=[], mut=None, pgle_profiler=None,
        **fields,
    )  # fmt: skip
    flat = jax.tree.leaves((call.args, call.kwargs))
    names = jax.tree.leaves(_argument_names(call))
    info = [
        stages.ArgInfo(core.shaped_abstractify(x), name in call.donated)
        for x, name in zip(flat, names, strict=True)
    ]
    out_tree = rebuild_tree(header["meta"]["out_tree"])
    return stages.Compiled(unloaded.load(), [], call.tree.unflatten(info), out_tree)


def _argument_names(call: Call) -> Any:
    """The dynamic arguments' tree with each leaf replaced by its argument's name."""
    named = zip(call.names, call.args, strict=True)
    args = tuple(jax.tree.map(lambda _, n=n: n, a) for n, a in named)
    kwargs = {n: jax.tree.map(lambda _, n=n: n, a) for n, a in call.kwargs.items()}
    return args, kwargs


def _difference(theirs: dict, call: Call) -> str:
    """The first fields in which an entry's key differs from the call's, in words."""
    ours = call.description
    out = []
    for part in ("environment", "function", "static", "leaves", "jit", "tree"):
        a, b = theirs.get(part), ours.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            out += [f"{part}.{k} {_short(a.get(k))} (here {_short(b.get(k))})" for k in keys]
        else:
            out.append(f"{part} differs")
    return "; ".join(out[:3]) or "its key differs"


def _short(x: Any) -> str:
    text = json.dumps(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _aval(a: Any) -> list:
    return [list(a.shape), str(a.dtype), bool(a.weak_type)]


def _sharding(s: Any) -> list:
    if type(s) is not jax.sharding.SingleDeviceSharding:
        raise NotSupported(f"a {type(s).__name__}")
    (device,) = s.device_set
    return [device.id, s.memory_kind]


def _layout(layout: Any) -> Any:
    if layout is None:
        return None
    return [
        list(layout.major_to_minor),
        [list(t) for t in layout.tiling],
        layout.sub_byte_element_size_in_bits,
    ]


def _fields(meta: dict, backend: Any) -> dict[str, Any]:
    """`pxla.UnloadedMeshExecutable`'s fields held in a header's `meta`."""
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax._src.layout import Layout
    from jax._src.lib import xla_client

    devices = {d.id: d for d in backend.devices()}

    def aval(x):
        return core.ShapedArray(tuple(x[0]), np.dtype(x[1]), weak_type=bool(x[2]))

    def sharding(x):
        return jax.sharding.SingleDeviceSharding(devices[x[0]], memory_kind=x[1])

    def layout(x):
        if x is None:
            return None
        return Layout(tuple(x[0]), tuple(tuple(t) for t in x[1]), x[2])

    all_in = [aval(a) for a in meta["all_in_avals"]]
    return {
        "name": str(meta["name"]),
        "device_list": xla_client.DeviceList(tuple(devices[i] for i in meta["devices"])),
        "committed": bool(meta["committed"]),
        "kept_var_idx": {int(i) for i in meta["kept"]},
        "input_avals": [aval(a) for a in meta["in_avals"]],
        "output_avals": [aval(a) for a in meta["out_avals"]],
        "input_shardings": [sharding(s) for s in meta["in_shardings"]],
        "output_shardings": [sharding(s) for s in meta["out_shardings"]],
        "xla_in_layouts": [layout(v) for v in meta["xla_in_layouts"]],
        "dispatch_in_layouts": [layout(v) for v in meta["dispatch_in_layouts"]],
        "xla_out_layouts": [layout(v) for v in meta["xla_out_layouts"]],
        "all_args_info": pxla.AllArgsInfo(all_in, core.DebugInfo("jit", meta["name"], None, None)),
    }


def timed(fn, *args) -> tuple[Any, float]:
    """`fn(*args)` and the seconds it took."""
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start
