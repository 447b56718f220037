"""The fixed-order probes' results kept on disk, so a new process runs none it ran before.

`fixed_order.shape_keeps_row_bits` measures, per product shape, whether this CPU's dot gives
a row the same bits for every row count of a decode tile (one small program per new shape).
What it measures is a fact about the machine and the compiler, not about the process, so
its answers are kept in one small JSON file, `probes.json` beside the compiled programs,
in the folder of the process's persistent compilation cache (`compile_cache.
programs_folder()`: `ll.enable_compile_cache`'s, which the command line, the lm-eval
backend and Ray actors turn on, or JAX's own). With no such cache on, or with
`LOGITLOOP_COMPILE_CACHE=off`, nothing is read or kept and the probes run in each process:

    {"format": "logitloop-fixed-order-probes", "version": 1,
     "machines": {"<machine key>": {"float32/dot/256x704": true, "bfloat16/head/64x512": false}}}

A result is used only under the machine key it was measured with (`machine_key`: jax and
jaxlib versions, backend, platform, CPU model and a digest of its flags, the threads this
process may use, `XLA_FLAGS`, the deterministic programs' compiler options and the probe's
own version), so another CPU, release or flag set sharing the folder probes again and adds
its own. The file is data only: read with `json.loads` and checked field by field; one
that cannot be read (a folder in its place, no permission), is not UTF-8 JSON, nests too
deep, is over `MAX_BYTES` or has another format is ignored with one warning per process
(and replaced at the next write where it can be), entries of another form are ignored: a
deterministic run never fails on it. A folder other users can write to is refused
(`compile_cache`'s check: a forged `true` would let rows run unpadded where they change
bits). Writes replace the file atomically, merged with what another process wrote since (a
lost race only costs a probe again).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

FILE_NAME = "probes.json"
MAX_BYTES = 1 << 22  # a record is a few kilobytes; a bigger file is not one
FORMAT = "logitloop-fixed-order-probes"
VERSION = 1
# Bump when the probe itself changes (its inputs, row counts or comparison): results of an
# older probe are then not read.
PROBE_VERSION = 1
_ENTRY = re.compile(r"^([a-z0-9_]+)/(dot|head)/([0-9]+)x([0-9]+)$")

Entry = tuple[str, bool, int, int]  # (dtype name, head, K or E, N or V)

_lock = threading.Lock()
_warned: set[str] = set()


def entry_name(entry: Entry) -> str:
    dtype, head, k, n = entry
    return f"{dtype}/{'head' if head else 'dot'}/{k}x{n}"


def _parse_entry(name: str) -> Entry | None:
    m = _ENTRY.match(name)
    if m is None:
        return None
    return m[1], m[2] == "head", int(m[3]), int(m[4])


def machine_key(options: dict[str, object]) -> str:
    """What a probe's answer depends on besides the shape, as one string (`options`: the
    compiler options of the probed programs)."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    model, flags = _cpu()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = {
        "probe": PROBE_VERSION,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "platform": f"{device.platform}/{device.client.platform_version}/{device.device_kind}",
        "cpu": model,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "threads": threads,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "options": {k: str(v) for k, v in sorted(options.items())},
    }
    return json.dumps(key, sort_keys=True)


def _cpu() -> tuple[str, str]:
    """This CPU's model name and feature flags (from /proc/cpuinfo; else the platform's)."""
    import platform

    model, flags = None, ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and model is None:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    return model or platform.processor() or platform.machine(), flags


def folder() -> Path | None:
    """Where the record lives: the folder of the compile cache in use, or None (no cache
    on, `LOGITLOOP_COMPILE_CACHE=off`, or a folder that other users can write to or this
    process cannot, warned about once)."""
    from logitloop import compile_cache

    chosen = compile_cache.programs_folder()
    if chosen is None or compile_cache.default_folder() is None:
        return None
    refused = compile_cache.unsafe_folder(chosen)
    if refused is not None:
        _warn_once(str(chosen), f"fixed-order probe results not kept in {chosen}: {refused}")
        return None
    return chosen


def load(key: str, where: Path | None = None) -> dict[Entry, bool]:
    """The results recorded for machine `key` (empty when there is no record)."""
    where = folder() if where is None else where
    if where is None:
        return {}
    machines = _read(where / FILE_NAME)
    out = {}
    for name, value in machines.get(key, {}).items():
        entry = _parse_entry(name)
        if entry is not None and isinstance(value, bool):
            out[entry] = value
    return out


def save(key: str, results: dict[Entry, bool], where: Path | None = None) -> None:
    """Add `results` to machine `key`'s record (merged with what is on disk now)."""
    where = folder() if where is None else where
    if where is None or not results:
        return
    path = where / FILE_NAME
    with _lock:
        machines = _read(path)
        mine = dict(machines.get(key, {}))
        mine.update({entry_name(e): bool(v) for e, v in results.items()})
        machines[key] = mine
        data = {"format": FORMAT, "version": VERSION, "machines": machines}
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=where, prefix=".probes-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            _warn_once(str(path), f"fixed-order probe results not written to {path}: {e}")


def _read(path: Path) -> dict[str, dict]:
    """The file's machines, checked; {} (with one warning) for a file that is not one."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn_once(str(path), f"fixed-order probe record {path} not read: {e}")
        return {}
    try:  # not UTF-8 (UnicodeDecodeError) or not JSON: ValueError; nested too deep: Recursion
        data = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_BYTES else None
    except (ValueError, RecursionError):
        data = None
    ok = (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and data.get("version") == VERSION
        and isinstance(data.get("machines"), dict)
    )
    if not ok:
        _warn_once(
            str(path),
            f"fixed-order probe record {path} ignored: not a {FORMAT} version {VERSION} file "
            "(it will be replaced; the probes run again)",
        )
        return {}
    return {k: v for k, v in data["machines"].items() if isinstance(k, str) and isinstance(v, dict)}


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"logitloop: {message}", stacklevel=3)
