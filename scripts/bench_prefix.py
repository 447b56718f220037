"""Shared prefixes (issue 45): prefill once, sample many; a prefix cache across requests.

    python scripts/bench_prefix.py                       # llama-40m, every part
    python scripts/bench_prefix.py --parts a --ns 1 4 16 --repeats 3
    python scripts/bench_prefix.py --size tiny --prompt 256 --prefix 192 --requests 32

A random `bench_generate` Llama (`--size`, float32, context 4096), on this machine's backend:

(a) `generate(model, [prompt], n=N, max_tokens=--new-tokens)` for each N of `--ns` on one
    prompt of `--prompt` random tokens: the prompt is prefilled once and its N rows share
    its pages (`logitloop.decoding.loop.forked`). Wall time against N = 1 (goal: N = 16 at
    most 2x N = 1), and, for N up to `--unshared-max`, the same rows without sharing
    (`generate` of the prompt repeated N times, each row prefilled: today's cost before
    shared prefixes). For N > 1 the same calls also run, in turns with them, without the
    shared-prefix (cascade) decode attention that reads the prompt's pages once per step
    (`plain_gather`: each row gathers its whole table, as before it), and one decode
    step's KV bytes gathered and XLA's bytes accessed are given both ways.
(b) `generate_many` of `--requests` requests: one few-shot prefix of `--prefix` random
    tokens, then a distinct question of 8-24 tokens each, `--answer` tokens each, with the
    prefix cache (the default) against `prefix_cache=False` (goal: at least 3x); the
    prefill tokens each computed (the job's `stats`).
(c) decode speed at a fixed batch: `generate_many` of `--slots` short distinct prompts and
    `--decode-tokens` tokens each, on the paged pool (the default) against contiguous
    slots (`prefix_cache=False`): the pool's decode step against the contiguous one.

Every timing is the median of `--repeats` runs after one warm-up run of the same shapes
(timed runs checked to compile nothing); tokens are checked equal between the variants.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import config  # scripts/ is on the path when run as a script
from flax import nnx
from timing import timed_turns

import logitloop as ll
from logitloop.decoding.engine import generate as generate_module
from logitloop.decoding.engine.batching import Request, generate_many
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.loop.decode_loop import decode_step
from logitloop.models import LlamaModel


def timed(fn, repeats: int, warm_up=None) -> tuple[float, object, int]:
    """`timed_turns` of one call."""
    return timed_turns({"": fn}, repeats, None if warm_up is None else {"": warm_up})[""]


def without_prefix(state):
    """The state with its layers' shared-prefix descriptor dropped (`layers.share_prefix`):
    each decode step then gathers every row's whole table, as before the cascade."""
    cache = [{k: v for k, v in layer.items() if k != "prefix"} for layer in state.cache]
    return state.replace(cache=cache)


@contextlib.contextmanager
def plain_gather():
    """`generate`'s n > 1 rows decode without the cascade (`without_prefix` on the state
    after prefill): the benchmark's switch for "before" in the same run."""
    start = generate_module._forked_state

    def forked_state(*args):
        plan, state = start(*args)
        return plan, without_prefix(state)

    with mock.patch.object(generate_module, "_forked_state", forked_state):
        yield


def kv_bytes(state) -> dict:
    """Bytes of keys and values one decode step gathers from the pool (every layer) once
    the rows are at their longest: each row's whole table (the gather path, whose table
    prefix is then all P entries), or each group's shared pages once and each row's
    `suffix_entries` after them (the cascade)."""
    layer = state.cache[0]
    hkv, _, page_size, d = layer["k_pages"].shape
    page = 2 * hkv * page_size * d * layer["k_pages"].dtype.itemsize * len(state.cache)
    rows, entries = state.pages.pages.tables.shape
    groups, width = layer["prefix"].tables.shape
    own = layer["prefix"].suffix_entries
    return dict(
        gather_kv_bytes=rows * entries * page, cascade_kv_bytes=(groups * width + rows * own) * page
    )


def step_costs(model, prompt, n: int, knobs) -> dict:
    """One decode step of `generate(model, [prompt], n=n, **knobs)` after its prefill, with
    the cascade and without it (`without_prefix`): `kv_bytes` and XLA's cost_analysis
    bytes accessed of each compiled step."""
    options, settings = Options.split("generate", dict(n=n, **knobs))
    run = generate_module._start(model, plan(model, options), [prompt], None, settings)
    program, tables = run.plan.program, run.tables
    out = kv_bytes(run.state)
    for name, state in (("cascade", run.state), ("gather", without_prefix(run.state))):
        step = jax.jit(decode_step, static_argnums=0).lower(program, tables, state).compile()
        cost = step.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out[f"{name}_step_bytes"] = float(cost.get("bytes accessed", float("nan")))
    return out


def part_a(model, args, rng) -> list[dict]:
    prompt = rng.integers(0, model.config.vocab_size, args.prompt).tolist()
    knobs = dict(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    rows = []
    for n in args.ns:

        def run(n=n):
            return ll.generate(model, [prompt], n=n, **knobs)

        def run_gather(n=n):
            with plain_gather():
                return ll.generate(model, [prompt], n=n, **knobs)

        fns = {"cascade": run} if n == 1 else {"cascade": run, "gather": run_gather}
        times = timed_turns(fns, args.repeats)
        secs, shared, compiled = times["cascade"]
        row = dict(n=n, seconds=secs, compiles=compiled, prefill_tokens=args.prompt)
        if n > 1:
            gather_s, gathered, gather_compiled = times["gather"]
            row.update(step_costs(model, prompt, n, knobs), gather_seconds=gather_s)
            row["compiles"] += gather_compiled
            row["gather_tokens_equal"] = gathered.token_ids == shared.token_ids
        if n <= args.unshared_max:
            params = ll.SamplingParams.create(1, max_tokens=args.new_tokens).samples(n)
            unshared_s, alone, _ = timed(
                lambda n=n, params=params: ll.generate(
                    model, [prompt] * n, params, ignore_eos=True
                ),
                args.repeats,
            )
            row.update(unshared_seconds=unshared_s, unshared_prefill_tokens=n * args.prompt)
            row["tokens_equal"] = alone.token_ids == shared.token_ids
        rows.append(row)
    base = rows[0]["seconds"]
    for row in rows:
        row["vs_n1"] = row["seconds"] / base
        if "gather_seconds" in row:
            row["gather_vs_n1"] = row["gather_seconds"] / base
    return rows


def part_b(model, args, rng) -> list[dict]:
    vocab = model.config.vocab_size
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    requests = [
        Request(
            prefix + rng.integers(0, vocab, int(rng.integers(8, 25))).tolist(),
            dict(max_tokens=args.answer, seed=i, temperature=0.8),
        )
        for i in range(args.requests)
    ]
    bounds = dict(
        slots=args.slots,
        ignore_eos=True,
        max_prompt_len=max(len(r.prompt) for r in requests),
        max_tokens_bound=args.answer,
    )
    few = requests[: 2 * args.slots]  # a warm-up of the same programs, a fourth of the work
    rows, tokens = [], {}
    for cache in (True, False):
        stats: dict = {}

        def job(cache=cache, stats=stats, requests=requests):
            stats.clear()
            return generate_many(model, requests, prefix_cache=cache, stats=stats, **bounds)

        secs, out, compiled = timed(job, args.repeats, lambda job=job: job(requests=few))
        tokens[cache] = [r.token_ids for r in out]
        prompt_tokens = sum(len(r.prompt) for r in requests)
        rows.append(
            dict(
                prefix_cache=cache,
                seconds=secs,
                compiles=compiled,
                prompt_tokens=prompt_tokens,
                prefill_tokens=stats.get("prefill_tokens", prompt_tokens),
            )
        )
    rows[0]["speedup"] = rows[1]["seconds"] / rows[0]["seconds"]
    rows[0]["tokens_equal"] = tokens[True] == tokens[False]
    return rows


def part_c(model, args, rng) -> list[dict]:
    vocab = model.config.vocab_size
    requests = [
        Request(rng.integers(0, vocab, 16).tolist(), dict(seed=i, temperature=0.8))
        for i in range(args.slots)
    ]
    bounds = dict(slots=args.slots, ignore_eos=True, max_tokens=args.decode_tokens)
    rows, tokens = [], {}
    for cache in (True, False):
        secs, out, compiled = timed(
            lambda cache=cache: generate_many(model, requests, prefix_cache=cache, **bounds),
            args.repeats,
        )
        tokens[cache] = [r.token_ids for r in out]
        steps = args.decode_tokens * args.slots
        rows.append(dict(pool=cache, seconds=secs, compiles=compiled, tokens_per_s=steps / secs))
    rows[0]["paged_vs_contiguous"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    rows[0]["tokens_equal"] = tokens[True] == tokens[False]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="llama-40m", help="bench_generate's model size")
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--prompt", type=int, default=2048, help="(a) prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=16, help="(a) tokens per row")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--unshared-max", type=int, default=4, help="(a) largest unshared n run")
    ap.add_argument("--prefix", type=int, default=1536, help="(b) shared prefix tokens")
    ap.add_argument("--requests", type=int, default=128, help="(b) requests")
    ap.add_argument("--answer", type=int, default=8, help="(b) tokens per request")
    ap.add_argument("--slots", type=int, default=16, help="(b, c) slots")
    ap.add_argument("--decode-tokens", type=int, default=128, help="(c) tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()

    model = LlamaModel(config(args.size, 4096), dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    record = dict(
        benchmark="bench_prefix",
        model=f"random {args.size} LlamaModel (float32)",
        backend=jax.default_backend(),
        load_average=os.getloadavg(),
        args=vars(args),
    )
    print(f"model: {record['model']}; backend {record['backend']}; load {os.getloadavg()}")
    if "a" in args.parts:
        record["a"] = part_a(model, args, rng)
        print(f"\n(a) generate, one prompt of {args.prompt} tokens, {args.new_tokens} new tokens")
        print(f"{'n':>4}{'seconds':>10}{'vs n=1':>8}{'gather s':>10}{'vs n=1':>8}"
              f"{'unshared s':>12}{'prefill tokens':>16}{'KV MB':>8}{'gather':>8}"
              f"{'XLA MB':>9}{'gather':>9}")  # fmt: skip
        for r in record["a"]:
            un = f"{r['unshared_seconds']:.2f}" if "unshared_seconds" in r else "-"
            gather, costs = f"{'-':>10}{'-':>8}", ""
            if "gather_seconds" in r:
                gather = f"{r['gather_seconds']:>10.2f}{r['gather_vs_n1']:>8.2f}"
                costs = (f"{r['cascade_kv_bytes'] / 1e6:>8.1f}{r['gather_kv_bytes'] / 1e6:>8.1f}"
                         f"{r['cascade_step_bytes'] / 1e6:>9.1f}"
                         f"{r['gather_step_bytes'] / 1e6:>9.1f}")  # fmt: skip
            print(f"{r['n']:>4}{r['seconds']:>10.2f}{r['vs_n1']:>8.2f}{gather}{un:>12}"
                  f"{r['prefill_tokens']:>16}{costs}")  # fmt: skip
        equal = all(r.get("gather_tokens_equal", True) for r in record["a"])
        print("seconds: generate as the library runs it (n > 1: the cascade); gather s: the "
              "same calls, in turns with them, with each row gathering its whole table "
              f"(tokens equal: {equal}). KV MB: keys and values one decode step gathers at "
              "the rows' longest (`kv_bytes`); XLA MB: XLA's cost_analysis bytes accessed by "
              "one decode step")  # fmt: skip
    if "b" in args.parts:
        record["b"] = part_b(model, args, rng)
        print(f"\n(b) generate_many, {args.requests} requests, a {args.prefix}-token prefix")
        print(f"{'prefix_cache':>13}{'seconds':>10}{'prompt tokens':>15}{'prefill tokens':>16}")
        for r in record["b"]:
            print(f"{r['prefix_cache']!s:>13}{r['seconds']:>10.2f}{r['prompt_tokens']:>15}"
                  f"{r['prefill_tokens']:>16}")  # fmt: skip
        b = record["b"][0]
        print(f"speedup {b['speedup']:.2f}x (goal >= 3x); tokens equal: {b['tokens_equal']}")
    if "c" in args.parts:
        record["c"] = part_c(model, args, rng)
        c = record["c"][0]
        print(f"\n(c) decode, {args.slots} rows x {args.decode_tokens} tokens: paged pool "
              f"{c['tokens_per_s']:.1f} tokens/s, contiguous {record['c'][1]['tokens_per_s']:.1f}"
              f" ({c['paged_vs_contiguous']:.2f}x); tokens equal: {c['tokens_equal']}")  # fmt: skip
    compiles = sum(r["compiles"] for p in "abc" for r in record.get(p, []))
    if compiles:
        print(f"warning: the timed runs compiled {compiles} programs")
    record["load_average_after"] = os.getloadavg()
    print(f"load average after: {record['load_average_after']}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
