"""Reuse before compiling: how many programs a notebook session and a scoring session
compile after one warm-up call (issue 70's table; docs/performance.md, "Reuse before
compiling").

    python scripts/bench_reuse.py                  # the shipped model, both sessions
    python scripts/bench_reuse.py --json out.json

`generate`: one warm-up `ll.generate` of 8 prompts with logprobs and a stop string, then 24
calls drawn with a fixed seed: batch 1-8, `max_tokens` 8-64, logprobs 0-5, a stop string
or none, `n` 1-2. `score`: one warm-up `ll.score` of 8 pairs with continuations of up to 12
tokens, then 6 calls of 1-8 pairs with continuations of 1-12 tokens. Each session counts
the programs logitloop compiled (`ll.compile_stats`, the same count as JAX's backend
compile events for these calls) and their seconds, after the warm-up, in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import logitloop as ll

WORDS = "the for statement a dictionary while loop import class def return yield".split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))


def generate_session(model, rng: random.Random) -> dict:
    ll.generate(model, [_prompt(rng) for _ in range(8)], max_tokens=16, logprobs=2,
                stop=["\n\n"], seed=0)  # fmt: skip
    ll.compile_stats(reset=True)
    start = time.perf_counter()
    for _ in range(24):
        batch = rng.randint(1, 8)
        kw = dict(max_tokens=rng.randint(8, 64), logprobs=rng.randint(0, 5), seed=rng.randint(0, 9))
        if rng.random() < 0.5:
            kw["stop"] = [rng.choice([".", "\n", " the"])]
        ll.generate(model, [_prompt(rng) for _ in range(batch)], n=rng.randint(1, 2), **kw)
    stats = ll.compile_stats()
    return dict(programs=stats.programs, compile_s=round(stats.seconds, 2),
                wall_s=round(time.perf_counter() - start, 2),
                reasons=[f"{e.program}: {e.reason}" for e in stats.events])  # fmt: skip


def score_session(model, rng: random.Random) -> dict:
    def pairs(n):
        conts = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
                 for _ in range(n)]  # fmt: skip
        return [_prompt(rng) for _ in range(n)], conts

    ll.score(model, *pairs(8))
    ll.compile_stats(reset=True)
    start = time.perf_counter()
    for _ in range(6):
        ll.score(model, *pairs(rng.randint(1, 8)))
    stats = ll.compile_stats()
    return dict(programs=stats.programs, compile_s=round(stats.seconds, 2),
                wall_s=round(time.perf_counter() - start, 2),
                reasons=[f"{e.program}: {e.reason}" for e in stats.events])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--session", choices=["generate", "score", "all"], default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = ll.load_pretrained()
    out = {}
    for name, fn in (("generate", generate_session), ("score", score_session)):
        if args.session in (name, "all"):
            out[name] = fn(model, random.Random(args.seed))
            r = out[name]
            print(f"{name}: {r['programs']} programs after the warm-up, {r['compile_s']} s "
                  f"compiling, {r['wall_s']} s in all")  # fmt: skip
            for reason in r["reasons"]:
                print("   ", reason)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
