"""The cost of `deterministic=True` in `ll.score` at lm-eval lengths, on the shipped model.

    python scripts/bench_deterministic_score.py
    python scripts/bench_deterministic_score.py --rows 8 --tokens 343 --repeats 5

Two jobs of `--rows` random sequences of `--tokens` tokens, float32: each sequence scored
as a continuation of its first token (lm-eval's `loglikelihood_rolling`: one continuation
pass) and as a prompt for its last token (a multiple-choice context: one prompt pass).
`deterministic=True` and `False` alternate, repeat by repeat, after one untimed warm-up
each (compiles, and the deterministic mode's probes); the table gives the median seconds
and the ratio deterministic / default. `--json PATH` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import logitloop as ll


def jobs(rows: int, tokens: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, vocab, tokens).tolist() for _ in range(rows)]
    return {
        "continuation": ([s[:1] for s in ids], [s[1:] for s in ids]),
        "prompt": ([s[:-1] for s in ids], [s[-1:] for s in ids]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=343)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = ll.load_pretrained(dtype="float32")
    results = {}
    print(f"{'job':<14}{'default s':>11}{'deterministic s':>17}{'ratio':>8}")
    for name, (prompts, conts) in jobs(args.rows, args.tokens, 4000).items():
        times = {False: [], True: []}
        for det in times:  # warm-up: compiles and probes
            ll.score(model, prompts, conts, batch_size=args.rows, deterministic=det)
        for _ in range(args.repeats):
            for det in times:
                start = time.perf_counter()
                ll.score(model, prompts, conts, batch_size=args.rows, deterministic=det)
                times[det].append(time.perf_counter() - start)
        plain, fixed = (statistics.median(times[d]) for d in (False, True))
        results[name] = {"default_s": plain, "deterministic_s": fixed, "ratio": fixed / plain}
        print(f"{name:<14}{plain:>11.3f}{fixed:>17.3f}{fixed / plain:>7.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
