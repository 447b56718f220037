"""The lm-eval backend against lm-eval's `hf` backend on the same offline tasks and model.

    python scripts/bench_eval.py [--docs 24] [--repeats 3] [--tasks ll_mc] [--json out.json]
    python scripts/bench_eval.py --cold [--tasks ll_mc,ll_rolling,ll_gen]

Tasks: a multiple-choice task (`--docs` questions of 4 choices), a rolling-perplexity
task (`--docs // 3` documents) and, with `--tasks ll_gen`, a generation task (`--docs //
2` story openings, greedy, stop at "." or a newline, at most 12 tokens: the tests' task),
written as JSONL + YAML to a temporary folder (the tests' `lm_eval_tasks.write_tasks`
format). Each backend is built once (one model instance, so
its compiled programs are reused), evaluated once untimed (warm-up: compiles, dataset
caches) and then `--repeats` times; the table gives the medians of the wall time of a
whole `simple_evaluate` call and of the backend's own calls in it (`loglikelihood`,
`loglikelihood_rolling`: what the backend does, without lm-eval's task building and
metrics, the same for both), and the ratios hf / logitloop (above 1: logitloop is faster). Also:
XLA's cost analysis of scoring one question's 4 choices as 4 full rows, with the shared
prompt pass `ll.score` runs, and one context row alone.

`--cold`: what a user waits for in a fresh process (issue 64): each backend in its own
subprocess, the model loaded (not timed), then one `simple_evaluate` timed with its
compiles (programs, `CompileWatch`, which counts a program loaded from the disk cache too;
the disk cache's hits beside it); the logitloop backends with the
persistent compilation cache off (`LOGITLOOP_COMPILE_CACHE=off`), and again as two
processes sharing a fresh cache folder (the second process's time: `warm disk cache`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

import logitloop as ll  # noqa: E402
from tests.integrations import lm_eval_tasks  # noqa: E402

WORDS = "girl boy cat dog park ball tree sun house car bird fish mom dad friend toy".split()


def make_docs(n: int, seed: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    mc = []
    for _ in range(n):
        story = " ".join(rng.choice(WORDS, size=40))
        mc.append(
            {
                "question": f"Once upon a time, {story}. The",
                "choices": [" " + str(w) for w in rng.choice(WORDS, size=4, replace=False)],
                "answer": 0,
            }
        )
    texts = [{"text": " ".join(rng.choice(WORDS, size=150)) + "."} for _ in range(max(1, n // 3))]
    gen = [
        {"question": "Once upon a time, " + " ".join(rng.choice(WORDS, size=6)), "answer": " the"}
        for _ in range(max(1, n // 2))
    ]
    return mc, texts, gen


# Generation as in GSM8K-style tasks: the same openings, each continued until a blank line or
# at most 64 tokens (lengths vary from row to row: the shipped model ends stories with EOS).
LONG_GENERATION = """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 64
  do_sample: false
metric_list:
  - metric: exact_match
"""


def time_backend(lm, tasks_at, tasks: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """Wall times of whole `simple_evaluate` calls, and of the backend's own calls in them
    (`loglikelihood`, `loglikelihood_rolling`, `generate_until`: what lm-eval asks the
    model for, without its task building and metrics)."""
    spent = [0.0]
    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        method = getattr(lm, name)

        def timed(*args, _method=method, **kw):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(lm, name, timed)
    lm_eval_tasks.evaluate(lm, None, tasks_at, tasks)  # warm-up
    whole, own = [], []
    for _ in range(repeats):
        spent[0] = 0.0
        t0 = time.perf_counter()
        lm_eval_tasks.evaluate(lm, None, tasks_at, tasks)
        whole.append(time.perf_counter() - t0)
        own.append(spent[0])
    return whole, own


def shared_prefix_cost(model, context_len: int = 64, choices: int = 4, cont_len: int = 4):
    """flops / bytes of the row batches' `score_batch` (deterministic; what `ll.score`
    runs with `mesh=`) for one context's `choices` rows: unshared (every row its own
    prompt pass), shared (one prompt pass, its cache gathered per row), and one row
    alone."""
    from logitloop.decoding.engine import score_rows as score_mod
    from logitloop.decoding.engine.host import MIN_PROMPT_BUCKET, bucket, prompt_batch
    from logitloop.decoding.engine.plan import Options, plan

    info = plan(model, Options(deterministic=True)).info
    out = {}
    for name, rows, shared in (("unshared", choices, False), ("shared", choices, True),
                               ("1 row", 1, False)):  # fmt: skip
        ids = [list(range(3, 3 + context_len))] * rows
        batch = prompt_batch(ids, bucket(cont_len, MIN_PROMPT_BUCKET), context_len)
        prompt, positions, row_prompt = batch.prompt, batch.positions, None
        if shared:
            prompt, positions = prompt[:1], positions[:1]
            row_prompt = np.zeros((rows,), np.int32)
        cont = np.full((rows, cont_len), 5, np.int32)
        lengths = np.full((rows,), cont_len, np.int32)
        traced = score_mod.score_batch.trace(
            info.runner, info.weights, prompt, positions, batch.lengths,
            batch.history, cont, lengths, None, None, None, row_prompt, num_top=0,
        )  # fmt: skip
        cost = traced.lower().compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[name] = {"flops": cost.get("flops", 0.0), "bytes": cost.get("bytes accessed", 0.0)}
    return out


COLD_BACKENDS = ("hf", "deterministic", "deterministic=false")


def cold_one(name: str, docs: int, tasks: list[str], batch_size: int) -> dict:
    """One backend's first `simple_evaluate` in this (fresh) process: wall seconds, programs
    compiled and seconds compiling (the model's loading is not timed)."""
    from lm_eval.tasks import TaskManager

    from logitloop.decoding.runtime.compiles import CompileWatch

    mc, texts, gen = make_docs(docs)
    lm_eval_tasks.DATA.update(ll_mc=mc, ll_rolling=texts, ll_gen=gen)
    manager = TaskManager(
        include_path=str(lm_eval_tasks.write_tasks(Path(tempfile.mkdtemp(prefix="bench_eval_"))))
    )
    shipped = Path(ll.__file__).parent / "models" / "tiny"
    if name == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(shipped), dtype="float32", batch_size=batch_size, device="cpu")
    else:
        from logitloop.integrations.lm_eval import LogitloopLM

        lm = LogitloopLM(pretrained=str(shipped), dtype="float32", batch_size=batch_size,
                         deterministic=name == "deterministic")  # fmt: skip
    import collections

    import jax

    events = collections.Counter()  # the persistent cache's: a hit loads, a miss writes
    jax.monitoring.register_event_listener(lambda event, **kw: events.update([event]))
    with CompileWatch() as watch:  # counts a program loaded from the disk cache too
        t0 = time.perf_counter()
        lm_eval_tasks.evaluate(lm, None, manager, tasks)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "programs": watch.count, "compile_s": watch.seconds,
            "cache_hits": events["/jax/compilation_cache/cache_hits"],
            "cache_misses": events["/jax/compilation_cache/cache_misses"]}  # fmt: skip


def cold(args, tasks: list[str]) -> dict:
    """`cold_one` of each backend in a subprocess of its own (module docstring)."""
    import subprocess

    def run(name: str, cache: str) -> dict:
        env = dict(os.environ, LOGITLOOP_COMPILE_CACHE=cache)
        cmd = [sys.executable, __file__, "--cold-one", name, "--docs", str(args.docs),
               "--tasks", ",".join(tasks), "--batch-size", str(args.batch_size)]  # fmt: skip
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = {}
    for name in COLD_BACKENDS:
        rows[name] = run(name, "off")
        if name != "hf":
            folder = tempfile.mkdtemp(prefix="bench_eval_cache_")
            run(name, folder)
            rows[f"{name}, warm disk cache"] = run(name, folder)
    ref = rows["hf"]["wall_s"]
    mc, texts, gen = make_docs(args.docs)
    print(f"\n{tasks}, first evaluation in a fresh process: {len(mc)} questions x 4 choices, "
          f"{len(texts)} rolling documents, {len(gen)} generations; batch_size "
          f"{args.batch_size}; ratio = this time / hf time")  # fmt: skip
    print(f"  {'backend':36s} {'wall':>8s} {'ratio':>7s} {'programs':>9s} {'compiling':>10s} "
          f"{'disk hits':>9s}")  # fmt: skip
    for name, r in rows.items():
        print(f"  {name:36s} {r['wall_s']:7.2f}s {r['wall_s'] / ref:6.2f}x {r['programs']:9d} "
              f"{r['compile_s']:9.2f}s {r.get('cache_hits', 0):9d}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--tasks", default="ll_mc,ll_rolling", help="comma-separated task names")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cost-only", action="store_true", help="only the XLA cost analysis")
    ap.add_argument("--cold", action="store_true", help="first evaluations in fresh processes")
    ap.add_argument("--cold-one", choices=COLD_BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_one:
        print(json.dumps(cold_one(args.cold_one, args.docs, args.tasks.split(","),
                                  args.batch_size)))  # fmt: skip
        return
    if args.cold:
        rows = cold(args, args.tasks.split(","))
        if args.json:
            args.json.write_text(json.dumps({"cold": rows}, indent=2))
        return
    if args.cost_only:
        shipped = Path(ll.__file__).parent / "models" / "tiny"
        print_cost(shared_prefix_cost(ll.load_pretrained(shipped, dtype="float32")))
        return

    from lm_eval.models.huggingface import HFLM

    from logitloop.integrations.lm_eval import LogitloopLM

    mc, texts, gen = make_docs(args.docs)
    lm_eval_tasks.DATA.update(ll_mc=mc, ll_rolling=texts, ll_gen=gen, ll_gen_long=gen)
    lm_eval_tasks.TASKS["ll_gen_long"] = LONG_GENERATION
    task_dir = lm_eval_tasks.write_tasks(Path(tempfile.mkdtemp(prefix="bench_eval_")))
    tasks = args.tasks.split(",")
    shipped = Path(ll.__file__).parent / "models" / "tiny"
    model = ll.load_pretrained(shipped, dtype="float32")
    backends = {
        "hf (torch, CPU)": HFLM(
            pretrained=str(shipped), dtype="float32", batch_size=args.batch_size, device="cpu"
        ),
        "logitloop deterministic": LogitloopLM(pretrained=model, batch_size=args.batch_size),
        "logitloop deterministic, unshared": LogitloopLM(
            pretrained=model, batch_size=args.batch_size, prefix_cache=False
        ),
        "logitloop deterministic=false": LogitloopLM(
            pretrained=model, batch_size=args.batch_size, deterministic=False
        ),
    }
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir))  # built once: it indexes lm-eval's library
    results, own = {}, {}
    for name, lm in backends.items():
        whole, calls = time_backend(lm, manager, tasks, args.repeats)
        results[name], own[name] = statistics.median(whole), statistics.median(calls)
        print(f"{name:36s} whole call median {results[name]:6.2f} s {[round(t, 2) for t in whole]}"
              f"; backend calls {own[name]:6.2f} s {[round(t, 2) for t in calls]}")  # fmt: skip  # noqa: E501
    ref, ref_own = results["hf (torch, CPU)"], own["hf (torch, CPU)"]
    print(f"\n{tasks}: {len(mc)} questions x 4 choices, {len(texts)} rolling documents, "
          f"{len(gen)} generations; batch_size {args.batch_size}; "
          "ratio = hf time / this time")  # fmt: skip
    print(f"  {'backend':36s} {'whole call':>10s} {'backend calls':>14s}")
    for name in results:
        print(f"  {name:36s} {ref / results[name]:9.2f}x {ref_own / own[name]:13.2f}x")
    cost = shared_prefix_cost(model)
    print_cost(cost)
    if args.json:
        args.json.write_text(
            json.dumps({"wall_s": results, "backend_s": own, "cost": cost}, indent=2)
        )


def print_cost(cost: dict) -> None:
    print("\nscore_batch, one 64-token context, 4 choices of 4 tokens (XLA cost analysis):")
    for name, c in cost.items():
        print(f"  {name:9s}: {c['flops'] / 1e9:.3f} GFLOP, {c['bytes'] / 1e6:.1f} MB accessed")
    one = cost["1 row"]
    for name in ("unshared", "shared"):
        print(f"  {name} / 1 row: flops {cost[name]['flops'] / one['flops']:.2f}x, "
              f"bytes {cost[name]['bytes'] / one['bytes']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
