"""The cost of exact RL log-probs: `ll.token_logprobs` (the trainer forward) with
`deterministic=True` against the default, on the shipped model, as ratios (median of
repeats after warm-up), and XLA's cost analysis of the two forward programs (flops and
bytes: what a GPU run would pay, which only a device can time).

    PYTHONPATH=$PWD python scripts/bench_rl.py --batch 8 --width 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from timing import median_time  # noqa: E402 - scripts/ is on the path when run as a script

import logitloop as ll
from logitloop.decoding.engine import trainer
from logitloop.decoding.engine.plan import Options, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = ll.load_pretrained()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    ids = rng.integers(3, vocab, (args.batch, args.width)).astype(np.int32)
    plen = np.full((args.batch,), args.width // 2, np.int32)
    params = ll.SamplingParams.create(args.batch, temperature=1.0, top_p=0.9)
    rows = {}
    for det in (False, True):

        def run(det=det):
            out = ll.token_logprobs(model, ids, plen, params, deterministic=det)
            out.raw_logprobs.block_until_ready()

        run()
        seconds = median_time(run, args.repeats, warmup=1)
        job = plan(model, Options(deterministic=det))
        inputs = trainer._Inputs(*trainer._checked_rows(ids, plen, None, vocab),
                                 trainer._checked_params(params, args.batch, job.info))  # fmt: skip
        lowered = trainer._program.trace(
            job.info.runner, job.info.weights, inputs, keep_mask=False, layout=job.layout
        ).lower()
        options = job.info.runner.numerics.compiler_options()
        cost = lowered.compile(compiler_options=options or None).cost_analysis() or {}
        rows[str(det)] = dict(
            seconds=seconds,
            flops=float(cost.get("flops", float("nan"))),
            bytes=float(cost.get("bytes accessed", float("nan"))),
        )
    d, p = rows["True"], rows["False"]
    print(f"token_logprobs, shipped model bf16, batch {args.batch}, width {args.width}")
    for name, row in (("default", p), ("deterministic", d)):
        ms = row["seconds"] * 1e3
        print(f"  {name:14s} {ms:8.1f} ms   flops {row['flops']:.3g}  bytes {row['bytes']:.3g}")
    time_ratio = d["seconds"] / p["seconds"]
    flops_ratio, bytes_ratio = d["flops"] / p["flops"], d["bytes"] / p["bytes"]
    print(
        f"  deterministic / default: time {time_ratio:.2f}x, flops {flops_ratio:.2f}x, "
        f"bytes {bytes_ratio:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
