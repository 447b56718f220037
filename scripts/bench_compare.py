"""Two source trees side by side: the sampler and the decode loop, alternating, one machine.

    python scripts/bench_compare.py --base ../old-checkout --new . --rounds 3

Each round runs one measuring process per tree (each with PYTHONPATH set to its tree), base
first in odd rounds and new first in even ones, so both see the same machine load in turn.
A process times `ll.sample` (batch 8 and 64 at V 32000 and 128256; greedy, top-p 0.9, every
knob per row, and a wide top-p 0.99) and `ll.generate` on the llama-40m configuration
(prompt 64, 128 new tokens; batch 1 and 8; greedy and top-p 0.9): each the median of
`--repeats` calls after a warm-up call (`--part` picks one half). The table gives, per
measurement present in both trees, the median over rounds for each tree and new / base
(below 1: the new tree is faster). Used to check that a refactor costs nothing. A tree with
user processors also times one trivial processor (one elementwise pass) against the same
call without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MEASURE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, "scripts")
from bench_generate import config
from bench_sampler import knobs
from timing import median_time
import logitloop as ll
from logitloop.models import LlamaModel

repeats, part = int(sys.argv[1]), sys.argv[2]
out = {}
rng = np.random.default_rng(0)
for vocab in (32000, 128256) if part in ("all", "sample") else ():
    for batch in (8, 64):
        logits = jnp.asarray(rng.normal(size=(batch, vocab)).astype(np.float32) * 4)
        hist = ll.History.create(rng.integers(0, vocab, (batch, 64)).tolist(), vocab, 256)
        pos = jnp.zeros(batch, jnp.int32)
        for name in ("greedy", "top_p", "all", "wide"):
            seeds = list(range(batch))
            p = ll.SamplingParams.create(batch_size=batch, seed=seeds, **knobs(name, batch))
            fn = lambda p=p: ll.sample(logits, p, pos, hist).tokens
            out[f"sample {batch}x{vocab} {name}"] = median_time(fn, repeats, warmup=1)
model = LlamaModel(config("llama-40m"), rngs=nnx.Rngs(0))
for batch in (1, 8) if part in ("all", "generate") else ():
    prompts = rng.integers(0, 32000, (batch, 64)).tolist()
    for name, extra in (("greedy", dict(temperature=0.0)), ("top_p", dict(top_p=0.9))):
        p = ll.SamplingParams.create(batch_size=batch, max_tokens=128, seed=0, **extra)
        fn = lambda p=p, prompts=prompts: ll.generate(model, prompts, p, ignore_eos=True).token_ids
        out[f"generate b{batch} {name}"] = median_time(fn, repeats, warmup=1)
if hasattr(ll, "Step"):  # trees with user processors: one trivial processor's cost
    from flax import struct

    @struct.dataclass
    class AddBias:  # one elementwise pass: logits + a per-row value
        bias: jax.Array

        def init(self, batch_size, vocab_size):
            return jnp.zeros((batch_size, 0))

        def apply(self, state, logits, step):
            return logits + self.bias[:, None]

        def update(self, state, tokens, step):
            return state

    for batch in (8, 64) if part in ("all", "sample") else ():
        logits = jnp.asarray(rng.normal(size=(batch, 128256)).astype(np.float32) * 4)
        pos = jnp.zeros(batch, jnp.int32)
        p = ll.SamplingParams.create(batch_size=batch, seed=list(range(batch)), top_p=0.9)
        proc = [AddBias(bias=jnp.full((batch,), 0.5))]
        fn = lambda p=p, proc=proc: ll.sample(logits, p, pos, processors=proc).tokens
        out[f"processor sample {batch}x128256 top_p"] = median_time(fn, repeats, warmup=1)
        fn = lambda p=p: ll.sample(logits, p, pos).tokens
        out[f"plain sample {batch}x128256 top_p"] = median_time(fn, repeats, warmup=1)
    for batch in (8,) if part in ("all", "generate") else ():
        prompts = rng.integers(0, 32000, (batch, 64)).tolist()
        p = ll.SamplingParams.create(batch_size=batch, max_tokens=128, seed=0, top_p=0.9)
        proc = [AddBias(bias=jnp.full((batch,), 0.5))]
        fn = lambda p=p, prompts=prompts, proc=proc: ll.generate(
            model, prompts, p, ignore_eos=True, processors=proc
        ).token_ids
        out[f"processor generate b{batch} top_p"] = median_time(fn, repeats, warmup=1)
print("RESULT:" + json.dumps(out))
"""


def measure(tree: Path, repeats: int, part: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(repeats), part],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT:"):
            return json.loads(line[len("RESULT:"):])
    raise SystemExit(f"{tree}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the old tree (a checkout)")
    ap.add_argument("--new", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--part", choices=("all", "sample", "generate"), default="all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(args.rounds):
        # Base first in odd rounds, new first in even ones: neither tree always runs second.
        for side in ("base", "new") if i % 2 == 0 else ("new", "base"):
            runs[side].append(measure(getattr(args, side).resolve(), args.repeats, args.part))
            print(f"round {i + 1} {side} done", file=sys.stderr, flush=True)
    rows = []
    print(f"{'measurement':<34} {'base ms':>9} {'new ms':>9} {'new/base':>9}")
    for key in (k for k in runs["base"][0] if k in runs["new"][0]):
        b = statistics.median(r[key] for r in runs["base"])
        n = statistics.median(r[key] for r in runs["new"])
        rows.append(dict(measurement=key, base=b, new=n, ratio=n / b))
        print(f"{key:<34} {1e3 * b:>9.2f} {1e3 * n:>9.2f} {n / b:>9.3f}")
    ratios = [r["ratio"] for r in rows]
    print(f"median new/base {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    # The new tree alone: one trivial processor against the same call without it.
    for key in runs["new"][0]:
        if not key.startswith("processor ") or key in runs["base"][0]:
            continue
        plain = key.replace("processor sample", "plain sample").replace("processor ", "")
        w = statistics.median(r[key] for r in runs["new"])
        wo = statistics.median(r[plain] for r in runs["new"])
        rows.append(dict(measurement=key, without=wo, with_processor=w, ratio=w / wo))
        print(f"{key:<34} {1e3 * wo:>9.2f} {1e3 * w:>9.2f} {w / wo:>9.3f}  (without, with)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(runs=runs, rows=rows), indent=2))


if __name__ == "__main__":
    main()
