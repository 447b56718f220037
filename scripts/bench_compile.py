"""What compiling costs a user: programs and seconds per call, each section in fresh processes.

    python scripts/bench_compile.py                          # every section
    python scripts/bench_compile.py --sections table first --out bench_out/compile.json
    python scripts/bench_compile.py --sections table --tree ../old-checkout   # a baseline

Sections:

- `table`: issue 64's table on the shipped model: after one warm-up `generate` of 3 prompts
  x 16 tokens, the seconds and programs of each call that changes one dimension (batch
  size, `max_tokens`, logprob width, a stop string, a JSON schema, `n`); then the same with
  `ll.precompile` of the job's buckets as the warm-up.
- `first`: the first `generate` of a fresh process (3 prompts x 16 tokens), default and
  `deterministic=True`: programs (logitloop's and JAX's small ones), seconds, and XLA's
  compile seconds of the costliest programs.
- `warm`: the first `generate` of a fresh process whose persistent compilation cache an
  earlier process filled, against no cache (`bench_compile_cache.py`'s children).

`--tree DIR` runs the children with DIR's `logitloop` (another checkout: a baseline in the
same run). Each child is a fresh Python process; the table prints seconds and program counts,
and `--out` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD_TABLE = r"""
import json, sys, time
import jax
import logitloop as ll
count = [0]
def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        count[0] += 1
jax.monitoring.register_event_duration_secs_listener(listener)
warm_up = sys.argv[1]
model = ll.load_pretrained()
P = ["The for statement", "A dictionary", "The with statement"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
rows = []
def run(label, prompts=P, **kw):
    kw.setdefault("max_tokens", 16)
    count[0] = 0
    t = time.perf_counter()
    ll.generate(model, prompts, **kw)
    rows.append(dict(call=label, seconds=time.perf_counter() - t, programs=count[0]))
if warm_up == "precompile":
    count[0] = 0
    t = time.perf_counter()
    for extra in ({}, {"logprobs": 1}, {"n": 2}, {"json_schema": SCHEMA}):
        ll.precompile(model, rows=[3, 8], prompt_len=16, max_tokens=64, **extra)
    rows.append(dict(call="warm-up: precompile", seconds=time.perf_counter() - t,
                     programs=count[0]))
else:
    run("warm-up: generate 3 x 16")
run("same call, other seed/temperature/top_k", seed=3, temperature=0.5, top_k=5)
run("batch 4", P + ["x"])
run("batch 5", P + ["x", "y"])
run("batch 7", P + ["x", "y", "z", "w"])
run("max_tokens 17", max_tokens=17)
run("max_tokens 40", max_tokens=40)
run("logprobs=2", logprobs=2)
run("logprobs=3", logprobs=3)
run("a stop string", stop=["\n"])
run("a JSON schema", json_schema={"type": "object", "properties": {"b": {"type": "string"}},
                                   "required": ["b"]})
run("n=2", n=2)
print(json.dumps(rows))
"""

CHILD_FIRST = r"""
import json, sys, time
import jax
import logitloop as ll
names = []
def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        names.append((kw.get("fun_name"), duration))
jax.monitoring.register_event_duration_secs_listener(listener)
model = ll.load_pretrained()
names.clear()
t = time.perf_counter()
ll.generate(model, ["The for statement", "A dictionary", "The with"], max_tokens=16,
            deterministic=sys.argv[1] == "deterministic")
seconds = time.perf_counter() - t
by_name = {}
for name, d in names:
    by_name.setdefault(name, [0, 0.0])
    by_name[name][0] += 1
    by_name[name][1] += d
print(json.dumps(dict(seconds=seconds, programs=len(names), backend={k: v for k, v in
                      sorted(by_name.items(), key=lambda kv: -kv[1][1])})))
"""


def _child(code: str, args: list[str], tree: Path | None) -> object:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree.resolve())
    env.setdefault("LOGITLOOP_COMPILE_CACHE", "off")
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(args) -> dict:
    result = {}
    for warm_up in ("generate", "precompile"):
        rows = _child(CHILD_TABLE, [warm_up], args.tree)
        result[warm_up] = rows
        print(f"\n{warm_up} as the warm-up: call | seconds | programs")
        for row in rows:
            print(f"  {row['call']:44s} {row['seconds']:7.2f} {row['programs']:4d}")
    return result


def first(args) -> dict:
    result = {}
    print("\nfirst generate of a fresh process: mode | seconds | programs (prefill + decode)")
    for mode in ("default", "deterministic"):
        runs = [_child(CHILD_FIRST, [mode], args.tree) for _ in range(args.repeats)]
        runs.sort(key=lambda r: r["seconds"])
        median = runs[len(runs) // 2]
        result[mode] = runs
        top = ", ".join(
            f"{k} x{n} {d:.1f} s" for k, (n, d) in list(median["backend"].items())[:4]
        )
        print(f"  {mode:14s} {median['seconds']:7.2f} {median['programs']:4d}  XLA: {top}")
    return result


def warm(args) -> dict:
    """A fresh process whose persistent cache an earlier one filled: its first `generate`
    (`bench_compile_cache.py`'s children, the shipped model)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_compile_cache as cache_bench

    with tempfile.TemporaryDirectory() as folder:
        cache_bench._first_call("warm", folder, 16)  # fills the folder
        runs = sorted(cache_bench._first_call("warm", folder, 16) for _ in range(args.repeats))
        cold = sorted(cache_bench._first_call("none", folder, 16) for _ in range(args.repeats))
    result = dict(warm=runs, cold=cold)
    w, c = runs[len(runs) // 2][0], cold[len(cold) // 2][0]
    print(f"\nfirst generate (1 prompt x 16 tokens) after loading: warm cache {w:.2f} s, "
          f"no cache {c:.2f} s ({c / w:.1f}x)")
    return result


SECTIONS = {"table": table, "first": first, "warm": warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement")
    ap.add_argument("--tree", type=Path, help="run the children with this checkout's logitloop")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = {"machine": platform.processor() or platform.machine(), "tree": str(args.tree)}
    for name in args.sections:
        results[name] = SECTIONS[name](args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
