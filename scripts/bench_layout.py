"""`generate` with n = 1 on the contiguous cache against the same call on a paged pool.

    python scripts/bench_layout.py                    # llama-40m and the shipped model
    python scripts/bench_layout.py --repeats 9 --out bench_out/layout.json

Issue 44 asks for one cache layout in `generate` and `stream` where the paged path costs
little: today `n > 1` runs on a pool (`loop/forked.py`) and `n = 1` on the contiguous cache
(`generate.on_pool`). This script runs the same `generate` call both ways (the pool by
making `on_pool` true for n = 1 too: the prompt prefilled into a pool of the contiguous
cache's memory, then the loop's decode steps with their page bookkeeping, `pool.grow`
and `pool.release`), counts the rows whose tokens differ (float32 llama-40m: none; the
shipped model runs in bfloat16, where the paged decode step's other order of sums can
flip a greedy near-tie), and gives the first call's time ratio (each layout compiles its
own programs) and the median wall time of `--repeats` calls after that first one, the two
layouts called in turn so that load on the machine falls on both alike, with the ratio
pool / contiguous. The whole call is timed (prefill, the decode loop, the host's
results): what a `generate` user pays.
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import numpy as np
from bench_generate import config  # scripts/ is on the path when run as a script
from flax import nnx

import logitloop as ll
from logitloop.decoding.engine import generate as gen
from logitloop.models import LlamaModel


def pool_too(plan) -> bool:
    """`on_pool` with n = 1 included."""
    return gen.sharing_refusal(plan) is None


def timed(model, prompts, tokens: int, layout: str) -> tuple[float, list]:
    with mock.patch.object(gen, "on_pool", pool_too if layout == "pool" else gen.on_pool):
        t0 = time.perf_counter()
        out = ll.generate(model, prompts, max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return time.perf_counter() - t0, out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    models = {
        "llama-40m": LlamaModel(config("llama-40m"), rngs=nnx.Rngs(0)),
        "shipped": ll.load_pretrained(),
    }
    rows = []
    head = ("model", "contiguous s", "pool s", "pool/contiguous", "first call", "rows differ")
    print("{:10} {:>13} {:>9} {:>16} {:>11} {:>12}".format(*head))
    for name, model in models.items():
        prompts = [list(range(1, 9 + 3 * i)) for i in range(args.rows)]
        times = {"contiguous": [], "pool": []}
        first = {}
        for repeat in range(args.repeats + 1):  # the first of each compiles: apart
            tokens = {}
            for layout in times:
                seconds, tokens[layout] = timed(model, prompts, args.tokens, layout)
                if repeat:
                    times[layout].append(seconds)
                else:
                    first[layout] = seconds
            differ = sum(a != b for a, b in zip(tokens["pool"], tokens["contiguous"], strict=True))
        med = {k: float(np.median(v)) for k, v in times.items()}
        ratio = med["pool"] / med["contiguous"]
        compile_ratio = first["pool"] / first["contiguous"]
        row = (name, med["contiguous"], med["pool"], ratio, compile_ratio, differ)
        print("{:10} {:13.3f} {:9.3f} {:16.2f} {:11.2f} {:12}".format(*row))
        rows.append(
            dict(model=name, rows=args.rows, tokens=args.tokens, **med, ratio=ratio)
            | dict(first_call_ratio=compile_ratio, rows_differ=differ)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
