"""MoE routing replay: how close the default (fast) mode's trainer log-probs come to the
rollout's with and without replaying the rollout's experts, and what recording and
replaying cost, on the RL tests' random bfloat16 Qwen3-MoE (tests/rl/family_models.py: 2
layers, 8 experts, 3 per token). Time ratios are medians of repeats after warm-up.

    PYTHONPATH=$PWD python scripts/bench_routing.py --batch 16 --tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import median_time  # noqa: E402 - scripts/ is on the path when run as a script

import logitloop as ll  # noqa: E402
from tests.rl.family_models import VOCAB, family_model  # noqa: E402 - the repository root


def padded(gen):
    """token_ids [B, T], prompt_lengths, lengths, routing [B, T, L, k], rollout raw [B, T]."""
    b = ll.rollout_batch(gen)
    return b.token_ids, b.prompt_lengths, b.lengths, b.routing, b.raw_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = family_model("qwen3_moe", "bfloat16")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, int(rng.integers(3, 12))).tolist() for _ in range(args.batch)]
    params = ll.SamplingParams.create(
        args.batch, temperature=1.0, max_tokens=args.tokens, seed=list(range(args.batch))
    )
    results = {}
    for det in (False, True):

        def rollout(record, det=det):
            return ll.generate(model, prompts, params, deterministic=det, ignore_eos=True,
                               return_routing=record)  # fmt: skip

        gen = rollout(True)
        ids, plen, lens, routing, raw = padded(gen)
        real = np.arange(ids.shape[1])[None, :] >= plen[:, None]
        real &= np.arange(ids.shape[1])[None, :] < lens[:, None]

        def trainer(replay, det=det, rows=(ids, plen, lens, routing)):
            ids, plen, lens, routing = rows
            out = ll.token_logprobs(model, ids, plen, lengths=lens, deterministic=det,
                                    routing=routing if replay else None)  # fmt: skip
            return np.asarray(out.raw_logprobs)

        row = {}
        for replay in (False, True):
            delta = np.abs(trainer(replay) - raw)[real]
            name = "replay" if replay else "own routing"
            row[name] = dict(max=float(delta.max()), mean=float(delta.mean()),
                             differing=int(np.count_nonzero(delta)))  # fmt: skip
        row["generate record / plain"] = median_time(
            lambda: rollout(True), args.repeats, warmup=1
        ) / median_time(lambda: rollout(False), args.repeats, warmup=1)
        row["token_logprobs replay / plain"] = median_time(
            lambda: trainer(True), args.repeats, warmup=1
        ) / median_time(lambda: trainer(False), args.repeats, warmup=1)
        results["deterministic" if det else "default"] = row
    tokens = int(args.batch * args.tokens)
    print(f"random Qwen3-MoE bf16, batch {args.batch}, {args.tokens} sampled tokens a row")
    for mode, row in results.items():
        print(f"{mode}:")
        for name in ("own routing", "replay"):
            d = row[name]
            print(f"  trainer vs rollout raw logprobs, {name:11s}: max |delta| {d['max']:.4g}, "
                  f"mean {d['mean']:.3g}, {d['differing']}/{tokens} tokens differ")  # fmt: skip
        print(f"  time: generate with return_routing / without "
              f"{row['generate record / plain']:.2f}x, token_logprobs with routing / without "
              f"{row['token_logprobs replay / plain']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
