"""What XLA compiling costs a user: programs and seconds of first calls, each in a fresh
Python process, by section.

    python scripts/bench_compile.py --section first            # the shipped model
    python scripts/bench_compile.py --section first --baseline /tmp/old   # vs another checkout
    python scripts/bench_compile.py --section depth --layers 4 16 32
    python scripts/bench_compile.py --section all --out bench_out/compile.json

Sections (`--section`, repeatable; `all` runs each):

- `first`: `ll.load_pretrained()`, then the first `ll.generate` of 3 prompts x 16 tokens
  (seed 1): `default`; `deterministic` with no fixed-order probe known
  (`LOGITLOOP_COMPILE_CACHE=off`); `deterministic-recorded`, the probes' results on disk
  from an earlier process (`logitloop.models.probe_record`; JAX's compilation cache stays
  off, so the model's programs still compile). `--baseline DIR` runs the same children
  with `DIR` (a checkout of another revision: `git archive REV logitloop | tar -x -C DIR`)
  first on the path, each repeat in turns with this checkout's.
- `table`: issue 64's table on the shipped model: after one warm-up `generate` of 3 prompts
  x 16 tokens, the seconds and programs of each call that changes one dimension (batch
  size, `max_tokens`, logprob width, a stop string, a JSON schema, `n`); then the same after
  `ll.precompile` of the job's buckets as the warm-up (`--baseline`: the generate warm-up
  with that checkout too).
- `warm`: the first `generate` of a fresh process whose persistent compilation cache an
  earlier process filled, against no cache (`bench_compile_cache.py`'s children).
- `options`: the shipped model's second `generate` (3 prompts x 16 tokens after a warm-up of
  one prompt, so its programs compile and no probe runs), default, deterministic, and
  deterministic with XLA:CPU's fusion emitters on or with none of the deterministic
  compiler options: what the deterministic programs' options cost to compile.
- `depth`: a Llama-3.2-1B-shaped model (hidden 2048, 32 heads, 8 kv heads of 64,
  intermediate 8192, vocab 128256, tied head; bfloat16), built from its config with
  pattern weights, every layer's weight of one shape the same buffer (compiling and the
  decode step's work do not depend on the values, and 32 layers then take 0.7 GB, not 4.4,
  beside other work in 24 GiB), at each of `--layers`: the first `ll.generate` of one
  prompt of 8 tokens x 16 new tokens, greedy, default mode.
- `scan` (an experiment, not a first call): one decode step of a Llama layer stack alone
  (`--scan-layers`, `--scan-hidden`; 64-wide heads, MLP 4x, float32 and bfloat16) as the
  models run it (layers unrolled) against `lax.scan` over the layers' stacked weights and
  caches and a `fori_loop` carrying the stacked cache: compile seconds and the step's
  median milliseconds (the calls in turns).

Each child of `first` and `depth` reports the programs XLA compiled during the call
(backend compiles, counted from JAX's monitoring events, by function name), the seconds of
those backend compiles, the call's wall time and its CPU time over all the process's
threads (which a loaded machine inflates less than wall time). Rows give the median over
`--repeats` fresh processes (the calls run in turns, so load on the machine falls on each
alike; a child killed for memory is noted and left out) and the ratio of medians against
the section's first row. `--out` writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The child's measuring part: `run()` is timed, with JAX's compile events counted.
MEASURE = r"""
import collections, json, time
import jax
names, secs = collections.Counter(), [0.0]
def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        names[kw.get("fun_name", "?")] += 1
        secs[0] += duration
jax.monitoring.register_event_duration_secs_listener(listen)
start, cpu = time.perf_counter(), time.process_time()
run()
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"programs": sum(names.values()), "compile_s": secs[0], "wall_s": wall,
                  "cpu_s": cpu, "by_name": dict(names.most_common())}))
"""

FIRST = r"""
import sys
import logitloop as ll
model = ll.load_pretrained()
deterministic = sys.argv[1] != "default"
def run():
    ll.generate(model, ["The for statement", "A dictionary", "x"], max_tokens=16, seed=1,
                deterministic=deterministic)
"""

# The programs of a second call (batch 3 after a warm-up of batch 1, so no probe runs) with
# the deterministic compiler options varied: which of them costs compile time.
OPTIONS = r"""
import sys
import logitloop as ll
from logitloop.models import numerics
variant = sys.argv[1]
if variant == "deterministic, fusion emitters on":
    numerics.CPU_COMPILER_OPTIONS = {**numerics.CPU_COMPILER_OPTIONS,
                                     "xla_cpu_use_fusion_emitters": True}
elif variant == "deterministic, no options":
    numerics.compiler_options = lambda model_parallel=False: {}
deterministic = variant != "default"
model = ll.load_pretrained()
ll.generate(model, ["x"], max_tokens=2, deterministic=deterministic)
def run():
    ll.generate(model, ["The for statement", "A dictionary", "x"], max_tokens=16, seed=1,
                deterministic=deterministic)
"""

DEPTH = r"""
import sys
import jax, numpy as np
import jax.numpy as jnp
from flax import nnx
import logitloop as ll
from logitloop.models import LlamaConfig, LlamaModel
config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_layers=int(sys.argv[1]), num_heads=32, num_kv_heads=8, head_dim=64,
                     max_position_embeddings=1024, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)
abstract = nnx.eval_shape(lambda: LlamaModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
graphdef, state = nnx.split(abstract)
block = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
shared = {}
def fill(s):  # one buffer per shape, shared by every layer: a 32-layer model in 0.7 GB
    key = (s.shape, s.dtype)
    if key not in shared:
        scale = 1.0 if len(s.shape) == 1 else s.shape[0] ** -0.5  # norms 1-ish, products unit
        shared[key] = jax.device_put((np.resize(block, s.shape) * scale).astype(s.dtype))
    return shared[key]
model = nnx.merge(graphdef, jax.tree.map(fill, state))
prompt = np.random.default_rng(1).integers(1, 128256, 8).tolist()
def run():
    ll.generate(model, [prompt], max_tokens=16, temperature=0.0, ignore_eos=True)
"""

# Not a first call: one decode step of the layer stack alone (no embedding, head, sampler),
# unrolled as the models run it against `lax.scan` over stacked weights and caches, and a
# `fori_loop` carrying the stacked cache (updated in place); compile s and step ms.
SCAN = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import logitloop as ll
from logitloop.models import LlamaConfig, LlamaModel
L, H, dtype, repeats = int(sys.argv[1]), int(sys.argv[2]), jnp.dtype(sys.argv[3]), int(sys.argv[4])
config = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=4 * H, num_layers=L,
                     num_heads=H // 64, num_kv_heads=max(H // 256, 1), head_dim=64,
                     max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True)
model = LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(0))
gdef, _ = nnx.split(model.layers[0])
states = [nnx.split(b)[1] for b in model.layers]
stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
stacked, cache = stack(states), model.init_cache(1, 1024, dtype)
stacked_cache = stack(cache)
x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, H)), dtype)
pos = jnp.full((1, 1), 100, jnp.int32)
at = lambda t, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), t)
# Each block of layer 0's graph (`ll.attention(layer=0)`) over a one-layer KV of its cache.
one = ll.KVSpec(1, config.num_kv_heads, config.head_dim, dtype)
def block(state, x, c):
    x, kv = nnx.merge(gdef, state)(x, pos, ll.KV([c], pos, one))
    return x, kv.finish()[0]
def unrolled(states, x, pos, cache):
    out = []
    for st, c in zip(states, cache):
        x, c = block(st, x, c)
        out.append(c)
    return x, out
def scan(stacked, x, pos, cache):
    return jax.lax.scan(lambda x, sc: block(sc[0], x, sc[1]), x, (stacked, cache))
def carried(stacked, x, pos, cache):
    def body(i, xc):
        h, c = block(at(stacked, i), xc[0], at(xc[1], i))
        up = lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u, i, 0)
        return h, jax.tree.map(up, xc[1], c)
    return jax.lax.fori_loop(0, L, body, (x, cache))
cases = {"unrolled": (unrolled, states, cache), "scan": (scan, stacked, stacked_cache),
         "fori_loop, cache carried": (carried, stacked, stacked_cache)}
out, fns = {}, {}
for name, (f, w, c) in cases.items():
    t = time.perf_counter()
    fns[name] = (jax.jit(f).lower(w, x, pos, c).compile(), w, c)
    out[name] = {"compile_s": time.perf_counter() - t, "step_ms": []}
for _ in range(repeats):
    for name, (f, w, c) in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(f(w, x, pos, c))
        out[name]["step_ms"].append((time.perf_counter() - t) * 1e3)
print(json.dumps(out))
"""


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


def child(code: str, argv: list[str], *, path: Path, env: dict[str, str]) -> dict:
    """One fresh process running `code` then MEASURE; its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(path), **env}
    out = subprocess.run(
        [sys.executable, "-c", code + MEASURE, *argv],
        check=True, capture_output=True, text=True, env=env, cwd=path,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def turns(cases: dict[str, tuple], repeats: int) -> dict[str, list[dict]]:
    """`repeats` measurements of each case (name -> `child` arguments), in turns."""
    got = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (code, argv, path, env) in cases.items():
            try:
                got[name].append(child(code, argv, path=path, env=env))
            except subprocess.CalledProcessError as e:  # e.g. killed for memory: noted, skipped
                print(f"  {name}: failed ({e.returncode})", file=sys.stderr, flush=True)
                continue
            print(f"  {name}: {got[name][-1]['programs']} programs, "
                  f"{got[name][-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    return got


def section_first(args, tmp: Path) -> dict[str, list[dict]]:
    record = tmp / "probes"
    trees = {"": ROOT} | ({"baseline ": args.baseline} if args.baseline else {})
    cases = {}
    for label, path in trees.items():
        cases[f"{label}default"] = (FIRST, ["default"], path, {"LOGITLOOP_COMPILE_CACHE": "off"})
        cases[f"{label}deterministic"] = (
            FIRST, ["deterministic"], path, {"LOGITLOOP_COMPILE_CACHE": "off"}
        )  # fmt: skip
    recorded = {"LOGITLOOP_COMPILE_CACHE": str(record)}
    child(FIRST, ["deterministic"], path=ROOT, env=recorded)  # writes the probes' record
    cases["deterministic-recorded"] = (FIRST, ["deterministic"], ROOT, recorded)
    return turns(cases, args.repeats)


def section_options(args, tmp: Path) -> dict[str, list[dict]]:
    env = {"LOGITLOOP_COMPILE_CACHE": "off"}
    variants = ("default", "deterministic", "deterministic, fusion emitters on",
                "deterministic, no options")  # fmt: skip
    return turns({v: (OPTIONS, [v], ROOT, env) for v in variants}, args.repeats)


def section_depth(args, tmp: Path) -> dict[str, list[dict]]:
    env = {"LOGITLOOP_COMPILE_CACHE": "off"}
    cases = {f"{n} layers": (DEPTH, [str(n)], ROOT, env) for n in args.layers}
    return turns(cases, args.repeats)


def section_scan(args, tmp: Path) -> dict:
    """The scan proxy (SCAN), one process per dtype; printed here (its rows are not first
    calls)."""
    got = {}
    for dtype in ("float32", "bfloat16"):
        argv = [str(args.scan_layers), str(args.scan_hidden), dtype, str(args.scan_steps)]
        cmd = [sys.executable, "-c", SCAN, *argv]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        got[dtype] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\nscan: one decode step of {args.scan_layers} layers, hidden {args.scan_hidden}, "
          f"median of {args.scan_steps} steps in turns")  # fmt: skip
    print(f"{'dtype':<9} {'layers as':<26} {'compile s':>9} {'step ms':>8} {'step ratio':>10}")
    for dtype, cases in got.items():
        base = statistics.median(cases["unrolled"]["step_ms"])
        for name, r in cases.items():
            step = statistics.median(r["step_ms"])
            print(f"{dtype:<9} {name:<26} {r['compile_s']:>9.2f} {step:>8.1f} {step / base:>10.2f}")
    return got


def section_table(args, tmp: Path) -> dict:
    """Issue 64's table (CHILD_TABLE), a fresh process per warm-up and tree; printed here."""
    trees = {"": ROOT} | ({"baseline ": args.baseline} if args.baseline else {})
    got = {}
    for label, path in trees.items():
        for warm_up in ("generate", "precompile"):
            if label and warm_up == "precompile":
                continue  # the baseline has no precompile
            env = {**os.environ, "PYTHONPATH": str(path), "LOGITLOOP_COMPILE_CACHE": "off"}
            out = subprocess.run(
                [sys.executable, "-c", CHILD_TABLE, warm_up],
                check=True, capture_output=True, text=True, env=env, cwd=path,
            )  # fmt: skip
            rows = json.loads(out.stdout.strip().splitlines()[-1])
            got[f"{label}{warm_up}"] = rows
            print(f"\n{label}warm-up by {warm_up}: call, seconds, programs")
            for row in rows:
                print(f"  {row['call']:44s} {row['seconds']:7.2f} {row['programs']:4d}")
    return got


def section_warm(args, tmp: Path) -> dict:
    """A fresh process whose persistent cache an earlier one filled: its first `generate`
    (`bench_compile_cache.py`'s children, the shipped model, 1 prompt x 16 tokens); printed
    here."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_compile_cache as cache_bench

    folder = str(tmp / "jax-cache")
    cache_bench._first_call("warm", folder, 16)  # fills the folder
    runs = sorted(cache_bench._first_call("warm", folder, 16) for _ in range(args.repeats))
    cold = sorted(cache_bench._first_call("none", folder, 16) for _ in range(args.repeats))
    w, c = runs[len(runs) // 2][0], cold[len(cold) // 2][0]
    print(f"\nwarm: first generate after loading: warm cache {w:.2f} s, no cache {c:.2f} s "
          f"({c / w:.1f}x)")  # fmt: skip
    return {"warm": runs, "cold": cold}


SECTIONS = {
    "first": section_first,
    "table": section_table,
    "warm": section_warm,
    "options": section_options,
    "depth": section_depth,
    "scan": section_scan,
}
PRINTED = {"scan", "table", "warm"}  # sections that print their own table


def table(title: str, got: dict[str, list[dict]]) -> None:
    print(f"\n{title}: median of the fresh processes (count in brackets)")
    print(f"{'case':<36} {'programs':>8} {'compile s':>10} {'wall s':>8} {'CPU s':>8} "
          f"{'wall ratio':>10}")  # fmt: skip
    base = None
    for name, runs in got.items():
        if not runs:
            print(f"{name:<36} (every run failed)")
            continue
        programs, compile_s, wall, cpu = (
            statistics.median(r[k] for r in runs)
            for k in ("programs", "compile_s", "wall_s", "cpu_s")
        )
        base = base or wall
        label = f"{name} ({len(runs)})"
        print(f"{label:<36} {programs:>8g} {compile_s:>10.2f} {wall:>8.2f} {cpu:>8.2f} "
              f"{wall / base:>10.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", action="append", choices=[*SECTIONS, "all"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--baseline", type=Path, help="another checkout, for `first`")
    ap.add_argument("--scan-layers", type=int, default=16)
    ap.add_argument("--scan-hidden", type=int, default=1024)
    ap.add_argument("--scan-steps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    chosen = args.section or ["first"]
    chosen = list(SECTIONS) if "all" in chosen else list(dict.fromkeys(chosen))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            results[name] = SECTIONS[name](args, Path(tmp))
            if name not in PRINTED:
                table(name, results[name])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
