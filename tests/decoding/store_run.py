"""Processes that run `generate` with logitloop's compile cache (and so its executable store)
in a folder, for `test_executable_store.py`:

    python -m tests.decoding.store_run fill FOLDER    # the first process: compiles, stores
    python -m tests.decoding.store_run check FOLDER   # loads; damaged and foreign entries;
                                                      # then killed while writing an entry

`fill` prints one JSON line of what it saw (the tokens, programs compiled and loaded, traces
of the stored programs, warnings); `check` prints its line, then kills itself in the middle
of writing an entry."""

from __future__ import annotations

import collections
import errno
import json
import os
import signal
import sys
import warnings
from pathlib import Path

import jax

PROMPT = "The for statement"
STORED = ("prefill", "decode")  # the programs `generate` runs, by jitted function name
traces: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_trace_duration" and kwargs.get("fun_name") in STORED:
        traces[kwargs["fun_name"]] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)

import logitloop as ll  # noqa: E402
from logitloop.decoding.runtime import executables  # noqa: E402

SHIPPED = '"vocab_size", ["int", "4098"]]'  # in the shipped model's keys only
TINY = '"vocab_size", ["int", "64"]]'  # in the tiny random Llama's
calls: dict[str, executables.Call] = {}  # the shipped model's calls, by program


def _remember_calls(load):
    def wrapper(call):
        if SHIPPED in json.dumps(call.description):
            calls[call.fn.__name__] = call
        return load(call)

    return wrapper


executables.load = _remember_calls(executables.load)
prefetched: list[str] = []  # programs whose executable a read ahead had ready


def _count_prefetched(take):
    def wrapper(call):
        out = take(call)
        if out is not None:
            prefetched.append(call.fn.__name__)
        return out

    return wrapper


executables._prefetched_for = _count_prefetched(executables._prefetched_for)


def _key_text(path: Path) -> str:
    body = path.read_bytes()
    start = len(executables.MAGIC) + 8
    length = int.from_bytes(body[len(executables.MAGIC) : start], "little")
    return json.dumps(json.loads(body[start : start + length])["key"])


def entry(folder: Path, program: str, model: str = SHIPPED) -> Path:
    """The store's entry of `program` ("prefill", "decode") whose key holds `model`."""
    for path in sorted(folder.glob("*.xla")):
        key = _key_text(path)
        if f':{program}"' in key and model in key:
            return path
    raise FileNotFoundError(f"no entry of {program} in {folder}")


def run(model, prompt=PROMPT, fresh: bool = True) -> dict:
    """`generate` as in a new process (`fresh`: in-memory programs dropped): tokens,
    counts, warnings."""
    if fresh:
        jax.clear_caches()
        executables._prefetched.clear()
    ll.compile_stats(reset=True)
    traces.clear()
    prefetched.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ll.generate(model, [prompt], max_tokens=3, temperature=0.0)
    stats = ll.compile_stats()
    return {
        "tokens": out.token_ids,
        "compiled": stats.programs,
        "loaded": stats.loaded,
        "traces": sum(traces.values()),
        "prefetched": list(prefetched),
        "warnings": _ours(caught),
        "summary": stats.summary(),
    }


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "logitloop" in str(w.message)]


def _rewrite_header(path: Path, change) -> None:
    """The entry with its header's key changed by `change(key)` (a foreign entry)."""
    body = path.read_bytes()
    start = len(executables.MAGIC) + 8
    length = int.from_bytes(body[len(executables.MAGIC) : start], "little")
    header = json.loads(body[start : start + length])
    change(header["key"])
    text = json.dumps(header).encode()
    rest = body[start + length :]
    path.write_bytes(executables.MAGIC + len(text).to_bytes(8, "little") + text + rest)


def _load_damaged(path: Path, damage) -> dict:
    """`executables.load` of prefill's call with its entry damaged (then restored)."""
    body = path.read_bytes()
    damage(path, body)
    executables._prefetched.clear()  # read from the file as it is now
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = executables.load(calls["prefill"])
    path.write_bytes(body)
    return {"refused": loaded is None, "warnings": _ours(caught)}


def _flip(path: Path, body: bytes) -> None:
    path.write_bytes(body[:-100] + bytes([body[-100] ^ 0xFF]) + body[-99:])


def check(store: Path, model) -> tuple[dict, object]:
    """What the checks saw, and prefill's executable as XLA compiled it (for the writes)."""
    out = {"clean": run(model)}
    # A corrupt entry in a run: refused, compiled again, replaced.
    _flip(entry(store, "prefill"), entry(store, "prefill").read_bytes())
    out["flipped"] = run(model)
    out["flipped_replaced"] = run(model)["loaded"]
    # Others as the loader meets them (the same path then compiles and replaces).
    tiny_prefill = entry(store, "prefill", TINY).read_bytes()
    damages = {
        "truncated": lambda p, b: p.write_bytes(b[: len(b) // 2]),
        "jax_version": lambda p, b: _rewrite_header(
            p, lambda key: key["environment"].update(jax="0.4.0")
        ),
        "other_model": lambda p, b: p.write_bytes(tiny_prefill),
    }
    for name, damage in damages.items():
        out[name] = _load_damaged(entry(store, "prefill"), damage)
    # A folder that cannot be written: one warning, nothing more. (An executable is
    # serialized before it first runs: XLA:CPU cannot serialize one that ran.)
    fresh = calls["prefill"].compile()
    executables.open = _read_only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            executables.save(calls["prefill"], fresh, fresh=True)
    out["read_only"] = _ours(caught)
    del executables.open
    executables._unwritable.clear()
    return out, fresh


def _read_only(*args):
    raise OSError(errno.EROFS, "Read-only file system")


def kill_while_writing(store: Path, compiled) -> None:
    """Remove prefill's entry, then write it again and die with half of it written."""
    entry(store, "prefill").unlink()

    class Half:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, body):
            self.file.write(body[: len(body) // 2])
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    executables.open = Half
    executables.save(calls["prefill"], compiled, fresh=True)


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    ll.enable_compile_cache(folder)
    model = ll.load_pretrained()
    store = folder / executables.FOLDER
    if mode == "fill":
        from tests.decoding.random_llama import small_llama

        tiny = run(small_llama(64, 64, seed=5), prompt=[1, 2, 3])
        # The shipped model's programs compiled ahead from structs (`ll.precompile`), then
        # run by `generate` with arrays: the same programs, in memory and on disk.
        traces.clear()
        report = ll.precompile(model, rows=[1], prompt_len=4, max_tokens=3)
        precompiled = {"programs": report.programs, "traces": sum(traces.values())}
        shipped = run(model, fresh=False)
        print(json.dumps({"precompiled": precompiled, "shipped": shipped, "tiny": tiny}))
        return
    out, fresh = check(store, model)
    print(json.dumps(out), flush=True)
    kill_while_writing(store, fresh)


if __name__ == "__main__":
    main()
