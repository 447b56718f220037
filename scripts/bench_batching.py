"""Continuous batching against fixed batches: many prompts of very different lengths.

    python scripts/bench_batching.py                          # 512 prompts, the small Llama
    python scripts/bench_batching.py --prompts 128 --out bench_out/batching.json
    python scripts/bench_batching.py --random-model           # a random tiny LlamaModel

One job, the same model, prompts, settings and slot count for both, in one run:

- `generate_many`: `logitloop.decoding.engine.batching.generate_many`: `--slots` rows kept busy,
  decoded in chunks of `--chunk-steps`, finished rows refilled from the queue.
- `generate`: `logitloop.generate` over fixed consecutive groups of `--slots` prompts; each
  group runs until its longest row stops.

- with `--paged-slots S`, `generate_many (paged)`: `--paged-slots` slots sharing one paged
  pool (`kv_cache_tokens`) of the memory the `--slots` contiguous rows hold (`slots * (P +
  N)` tokens, or `--kv-cache-tokens`) in pages of `--page-size`: more rows in flight at
  equal KV memory.

With `--repeats K` each is timed K times, alternating, and the best time is reported (the
other runs are in the JSON).

Prompts are random token ids (lengths `--prompt-len` range), each with its own seed and a
`max_tokens` drawn uniformly from `--tokens` (default 8..256), `--temperature` 0.8, `--top-p` 0.95,
EOS ignored (so a row's length is its max_tokens; `--respect-eos` to stop at EOS), all from
`--seed`. Every compile happens in a warm-up before the timed runs (the timed runs are checked
to compile nothing). Reported: generated tokens per second for each and the ratio, and how
many prompts got different tokens from the two (expected 0; float rounding of different
shapes can in principle flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import config  # scripts/ is on the path when run as a script
from flax import nnx

import logitloop as ll
from logitloop.decoding.engine.batching import Request, generate_many
from logitloop.decoding.engine.generate import MIN_BUFFER_BUCKET, MIN_PROMPT_BUCKET, bucket
from logitloop.decoding.runtime.compiles import CompileWatch
from logitloop.models import LlamaModel, load_pretrained


def random_model(seed: int = 0, size: str = "tiny") -> LlamaModel:
    """A bench_generate Llama, random, float32 ("tiny": vocabulary 512, 2 layers of 64)."""
    return LlamaModel(config(size), dtype=jnp.float32, rngs=nnx.Rngs(seed))


def workload(args, vocab: int) -> list[tuple[list[int], dict]]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    tlo, thi = args.tokens
    jobs = []
    for _ in range(args.prompts):
        prompt = rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).tolist()
        knobs = dict(
            temperature=args.temperature,
            top_p=args.top_p,
            seed=int(rng.integers(0, 2**31)),
            max_tokens=int(rng.integers(tlo, thi + 1)),
        )
        jobs.append((prompt, knobs))
    return jobs


def run_groups(model, jobs, slots, ignore_eos):
    """`generate` over consecutive groups of `slots` prompts; returns the token ids."""
    out = []
    for start in range(0, len(jobs), slots):
        group = jobs[start : start + slots]
        params = ll.SamplingParams.create(
            len(group),
            temperature=[k["temperature"] for _, k in group],
            top_p=[k["top_p"] for _, k in group],
            seed=[k["seed"] for _, k in group],
            max_tokens=[k["max_tokens"] for _, k in group],
        )
        res = ll.generate(model, [p for p, _ in group], params, ignore_eos=ignore_eos)
        out.extend(res.token_ids)
    return out


def run_many(model, jobs, args, bounds, **paged):
    """`generate_many`; `paged`: its `slots`, `kv_cache_tokens`, `page_size`, `stats`."""
    results = generate_many(
        model,
        (Request(p, k) for p, k in jobs),  # a generator, as a job reading a file would pass
        **{"slots": args.slots, **paged},
        chunk_steps=args.chunk_steps,
        prefill_batch=args.prefill_batch,
        ignore_eos=not args.respect_eos,
        **bounds,
    )
    return [r.token_ids[0] for r in results]


def paged_options(args, bounds) -> dict:
    """The paged run's `generate_many` keywords: the contiguous slots' KV memory in a pool."""
    cap = bucket(bounds["max_prompt_len"], MIN_PROMPT_BUCKET)
    cap += bucket(bounds["max_tokens_bound"], MIN_BUFFER_BUCKET)
    tokens = args.kv_cache_tokens or args.slots * cap
    return dict(slots=args.paged_slots, kv_cache_tokens=tokens, page_size=args.page_size)


def warm_up(model, jobs, args, bounds):
    """Compile every program the timed runs use, running as little as possible."""
    slots = args.slots
    ignore_eos = not args.respect_eos
    shapes = set()
    for start in range(0, len(jobs), slots):
        group = jobs[start : start + slots]
        plen = bucket(max(len(p) for p, _ in group), MIN_PROMPT_BUCKET)
        buf = bucket(max(k["max_tokens"] for _, k in group), MIN_BUFFER_BUCKET)
        shapes.add((len(group), plen, buf))
    for size, plen, buf in sorted(shapes):
        # one row of the longest prompt and a max_tokens in the same buffer bucket
        group = [([1] * plen, dict(jobs[0][1], max_tokens=buf // 2 + 1))]
        group += [([1], dict(jobs[0][1], max_tokens=1))] * (size - 1)
        run_groups(model, group, size, ignore_eos)
    few = [(p, dict(k, max_tokens=min(k["max_tokens"], 4))) for p, k in jobs[: 2 * slots]]
    run_many(model, few, args, bounds)
    if args.paged_slots:
        run_many(model, few, args, bounds, **paged_options(args, bounds), stats={})
    return sorted(shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    ap.add_argument(
        "--random-model",
        nargs="?",
        const="tiny",
        default=None,
        help="a random LlamaModel of bench_generate's sizes (default tiny; or llama-40m)",
    )
    ap.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--prefill-batch", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(4, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--respect-eos", action="store_true", help="stop rows at the model's EOS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed runs of each (alternating); best is kept"
    )
    ap.add_argument("--paged-slots", type=int, default=0, help="also run a paged pool's job")
    ap.add_argument("--kv-cache-tokens", type=int, default=0, help="its pool (default: equal)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()

    if args.random_model:
        model = random_model(size=args.random_model)
        name = f"random {args.random_model} LlamaModel (float32)"
    else:
        model, name = (
            load_pretrained(args.model, dtype=args.dtype),
            f"{args.model or 'shipped model'} ({args.dtype})",
        )
    vocab = model.config.vocab_size
    jobs = workload(args, vocab)
    bounds = dict(
        max_prompt_len=max(len(p) for p, _ in jobs),
        max_tokens_bound=max(k["max_tokens"] for _, k in jobs),
    )
    print(f"model: {name}; {len(jobs)} prompts, slots {args.slots}, chunk {args.chunk_steps}")
    print(f"backend: {jax.default_backend()}, {jax.device_count()} device(s)")

    counter = CompileWatch()
    t0 = time.perf_counter()
    shapes = warm_up(model, jobs, args, bounds)
    warm_s = time.perf_counter() - t0
    print(f"warm-up (compiles) {warm_s:.1f} s; generate group shapes {shapes}")

    times: dict[str, list[float]] = {"generate_many": [], "generate": []}
    stats: dict = {}
    if args.paged_slots:
        times["generate_many (paged)"] = []
    tokens_by = {}
    compiled = dict.fromkeys(times, 0)
    for _ in range(args.repeats):
        for method in times:
            with counter:
                t = time.perf_counter()
                if method == "generate":
                    ids = run_groups(model, jobs, args.slots, not args.respect_eos)
                elif method == "generate_many (paged)":
                    paged = paged_options(args, bounds)
                    ids = run_many(model, jobs, args, bounds, **paged, stats=stats)
                else:
                    ids = run_many(model, jobs, args, bounds)
                times[method].append(time.perf_counter() - t)
            compiled[method] += counter.count
            tokens_by[method] = ids
    rows = []
    for method, secs in times.items():
        tokens = sum(len(x) for x in tokens_by[method])
        best = min(secs)
        rows.append(
            dict(
                method=method,
                prompts=len(jobs),
                tokens=tokens,
                seconds=best,
                all_seconds=secs,
                tokens_per_s=tokens / best,
                compiles=compiled[method],
            )
        )
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    mismatched = sum(
        a != b for a, b in zip(tokens_by["generate_many"], tokens_by["generate"], strict=True)
    )

    print()
    print(
        f"{'method':<22}{'prompts':>8}{'tokens':>9}{'seconds':>10}{'tokens/s':>11}{'compiles':>10}"
    )
    for r in rows:
        print(
            f"{r['method']:<22}{r['prompts']:>8}{r['tokens']:>9}{r['seconds']:>10.2f}"
            f"{r['tokens_per_s']:>11.1f}{r['compiles']:>10}"
        )
    print(f"\ngenerate_many / generate: {ratio:.2f}x tokens/s (goal >= 1.5x)")
    if args.paged_slots:
        paged = paged_options(args, bounds)
        print(
            f"paged / contiguous generate_many at equal KV memory ({paged['kv_cache_tokens']} "
            f"tokens; {args.slots} contiguous slots, {args.paged_slots} paged slots): "
            f"{rows[2]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x tokens/s; paged rows "
            f"in flight at most {stats['most_rows_in_flight']}, preemptions "
            f"{stats['preemptions']}"
        )
        paged_ids, ids = tokens_by["generate_many (paged)"], tokens_by["generate_many"]
        differ = sum(a != b for a, b in zip(paged_ids, ids, strict=True))
        print(f"prompts whose tokens differ, paged against contiguous: {differ} of {len(jobs)}")
    compiles = sum(compiled.values())
    if compiles:
        print(f"warning: the timed runs compiled {compiles} programs")
    print(f"prompts whose tokens differ between the two: {mismatched} of {len(jobs)}")

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = dict(
            benchmark="bench_batching",
            model=name,
            backend=jax.default_backend(),
            machine=platform.machine(),
            args={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            bounds=bounds,
            warm_up_s=warm_s,
            results=rows,
            ratio=ratio,
            timed_compiles=compiles,
            mismatched_prompts=mismatched,
            paged_stats=stats,
        )
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
