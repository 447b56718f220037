"""Two source trees side by side: the sampler and the decode loop, alternating, one machine.

    python scripts/bench_compare.py --base ../old-checkout --new . --rounds 10

Each tree gets `--workers` long-lived measuring processes (PYTHONPATH set to its tree) that
compile every measurement first and then wait. The driver then alternates single
measurements between the trees: in each round, for each measurement, every process runs it
once (one `generate` call, or the median of `--repeats` sampler calls), base first in odd
rounds and new first in even ones. A measurement of one tree is thus never more than a few
seconds from the other's, so the machine's slow drifts (other jobs on shared cores) fall on
both alike; a ratio is taken per round (mean over each tree's processes) and the table gives
the median of those ratios, with the per-tree medians beside it (below 1: the new tree is
faster).

A process times `ll.sample` (batch 8 and 64 at V 32000 and 128256; greedy, top-p 0.9, every
knob per row, and a wide top-p 0.99) and `ll.generate` on the llama-40m configuration
(prompt 64, 128 new tokens; batch 1 and 8; greedy and top-p 0.9), and its prefill alone (a
512-token prompt and one new token, batch 1 and 8); `--part` picks one half.
Used to check that a refactor costs nothing. A tree with user processors also times one
trivial processor (one elementwise pass) against the same call without it.

(An earlier version ran one fresh process per tree and round. Rounds of one tree then
spread by 10-20% at batch 1, as much between processes as between trees, and a 5% check
could not be read off 4 rounds.)
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
out = {}  # name -> a function of no arguments, timed by the driver's requests
rng = np.random.default_rng(0)
for vocab in (32000, 128256) if part in ("all", "sample") else ():
    for batch in (8, 64):
        logits = jnp.asarray(rng.normal(size=(batch, vocab)).astype(np.float32) * 4)
        hist = ll.History.create(rng.integers(0, vocab, (batch, 64)).tolist(), vocab, 256)
        pos = jnp.zeros(batch, jnp.int32)
        for name in ("greedy", "top_p", "all", "wide"):
            seeds = list(range(batch))
            p = ll.SamplingParams.create(batch_size=batch, seed=seeds, **knobs(name, batch))
            fn = lambda p=p, x=logits, pos=pos, h=hist: ll.sample(x, p, pos, h).tokens
            out[f"sample {batch}x{vocab} {name}"] = fn
model = LlamaModel(config("llama-40m"), rngs=nnx.Rngs(0))
for batch in (1, 8) if part in ("all", "generate") else ():
    prompts = rng.integers(0, 32000, (batch, 64)).tolist()
    for name, extra in (("greedy", dict(temperature=0.0)), ("top_p", dict(top_p=0.9))):
        p = ll.SamplingParams.create(batch_size=batch, max_tokens=128, seed=0, **extra)
        fn = lambda p=p, prompts=prompts: ll.generate(model, prompts, p, ignore_eos=True).token_ids
        out[f"generate b{batch} {name}"] = fn
    # Prefill alone: a 512-token prompt and one new token (a prompt pass and a sample).
    p = ll.SamplingParams.create(batch_size=batch, max_tokens=1, seed=0, temperature=0.0)
    long_prompts = rng.integers(0, 32000, (batch, 512)).tolist()
    fn = lambda p=p, prompts=long_prompts: ll.generate(model, prompts, p, ignore_eos=True).token_ids
    out[f"generate b{batch} prefill 512"] = fn
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
        fn = lambda p=p, proc=proc, x=logits, pos=pos: ll.sample(x, p, pos, processors=proc).tokens
        out[f"processor sample {batch}x128256 top_p"] = fn
        fn = lambda p=p, x=logits, pos=pos: ll.sample(x, p, pos).tokens
        out[f"plain sample {batch}x128256 top_p"] = fn
    for batch in (8,) if part in ("all", "generate") else ():
        prompts = rng.integers(0, 32000, (batch, 64)).tolist()
        p = ll.SamplingParams.create(batch_size=batch, max_tokens=128, seed=0, top_p=0.9)
        proc = [AddBias(bias=jnp.full((batch,), 0.5))]
        fn = lambda p=p, prompts=prompts, proc=proc: ll.generate(
            model, prompts, p, ignore_eos=True, processors=proc
        ).token_ids
        out[f"processor generate b{batch} top_p"] = fn
for fn in out.values():
    jax.block_until_ready(fn())  # compile
print("READY:" + json.dumps(list(out)), flush=True)
for line in sys.stdin:  # one measurement name per line -> its median seconds
    name = line.strip()  # one `generate` call (128 steps), or `repeats` sampler calls
    print(median_time(out[name], 1 if "generate" in name else repeats), flush=True)
"""


class Worker:
    """One measuring process of one tree: `names` once it has compiled, `time(name)` then."""

    def __init__(self, tree: Path, repeats: int, part: str):
        env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
        self.tree = tree
        self.proc = subprocess.Popen(
            [sys.executable, "-c", MEASURE, str(repeats), part],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> list[str]:
        line = self.proc.stdout.readline()
        if not line.startswith("READY:"):
            raise SystemExit(f"{self.tree}: the measuring process failed ({line!r})")
        return json.loads(line[len("READY:") :])

    def time(self, name: str) -> float:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the old tree (a checkout)")
    ap.add_argument("--new", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5, help="sampler calls per measurement")
    ap.add_argument("--workers", type=int, default=1, help="measuring processes per tree")
    ap.add_argument("--part", choices=("all", "sample", "generate"), default="all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sides = ("base", "new")
    workers = {
        side: [
            Worker(getattr(args, side).resolve(), args.repeats, args.part)
            for _ in range(args.workers)
        ]
        for side in sides
    }
    names = {side: [w.ready() for w in ws][0] for side, ws in workers.items()}
    print("compiled; measuring", file=sys.stderr, flush=True)
    shared = [k for k in names["base"] if k in names["new"]]
    only_new = [k for k in names["new"] if k not in names["base"]]
    # runs[side][name][round] = the mean over that side's processes
    runs = {side: {k: [] for k in names[side]} for side in sides}
    for i in range(args.rounds):
        for key in shared + only_new:
            # Base first in odd rounds, new first in even ones: neither tree always runs second.
            for side in sides if i % 2 == 0 else sides[::-1]:
                if key in runs[side]:
                    times = [w.time(key) for w in workers[side]]
                    runs[side][key].append(statistics.mean(times))
        print(f"round {i + 1} done", file=sys.stderr, flush=True)
    for ws in workers.values():
        for w in ws:
            w.close()
    rows = []
    print(f"{'measurement':<34} {'base ms':>9} {'new ms':>9} {'new/base':>9} {'quartiles':>13}")
    for key in shared:
        b, n = runs["base"][key], runs["new"][key]
        per_round = [y / x for x, y in zip(b, n, strict=True)]
        ratio = statistics.median(per_round)
        q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [ratio] * 3
        rows.append(
            dict(
                measurement=key,
                base=statistics.median(b),
                new=statistics.median(n),
                ratio=ratio,
                quartiles=[q1, q3],
            )
        )
        print(
            f"{key:<34} {1e3 * statistics.median(b):>9.2f} {1e3 * statistics.median(n):>9.2f}"
            f" {ratio:>9.3f}   {q1:.3f}-{q3:.3f}"
        )
    ratios = [r["ratio"] for r in rows]
    print(f"median new/base {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    # The new tree alone: one trivial processor against the same call without it.
    for key in only_new:
        if not key.startswith("processor "):
            continue
        plain = key.replace("processor sample", "plain sample").replace("processor ", "")
        w = statistics.median(runs["new"][key])
        wo = statistics.median(runs["new"][plain])
        rows.append(dict(measurement=key, without=wo, with_processor=w, ratio=w / wo))
        print(f"{key:<34} {1e3 * wo:>9.2f} {1e3 * w:>9.2f} {w / wo:>9.3f}  (without, with)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(runs=runs, rows=rows), indent=2))


if __name__ == "__main__":
    main()
