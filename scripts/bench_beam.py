"""Beam-search benchmark: `ll.beam_search` against transformers' `generate(num_beams=K)`.

    python scripts/bench_beam.py
    python scripts/bench_beam.py --beams 4 --batch 1 4 --prompt 32 --new-tokens 32

bench_generate's ~40M-parameter Llama (random, float32, no EOS: every beam runs to
`--new-tokens`), written by transformers and loaded by logitloop; `--batch` prompts of
`--prompt` random tokens searched together with `--beams` beams (length penalty 1, early
stopping True). logitloop's whole search is one compiled `lax.while_loop`; transformers'
is its Python loop over PyTorch CPU. The two alternate, repeat by repeat, after one
untimed warm-up each (logitloop's compiles); the table gives the median seconds per
search, the ratio, and whether the best sequences agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from bench_generate import peer_pair  # scripts/ is on the path

import logitloop as ll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    hf, model = peer_pair("llama-40m")
    rows = []
    for batch in args.batch:
        prompts = np.random.default_rng(batch).integers(1, hf.config.vocab_size, (batch, 32))
        prompts = prompts[:, : args.prompt].tolist()

        def ours(prompts=prompts):
            return ll.beam_search(model, prompts, num_beams=args.beams, max_tokens=args.new_tokens)

        ids = torch.tensor(prompts)

        def theirs(ids=ids):
            with torch.inference_mode():
                return hf.generate(
                    ids, attention_mask=torch.ones_like(ids), num_beams=args.beams,
                    do_sample=False, max_new_tokens=args.new_tokens, early_stopping=True,
                    pad_token_id=0, eos_token_id=None,
                )  # fmt: skip

        t0 = time.perf_counter()
        found = ours()
        warm_s = time.perf_counter() - t0
        ref = theirs()[:, args.prompt :].tolist()
        times = []
        for _ in range(args.repeats):  # alternate: the same state of the shared machine
            t0 = time.perf_counter()
            ours()
            t1 = time.perf_counter()
            theirs()
            times.append((t1 - t0, time.perf_counter() - t1))
        t_ours = statistics.median(t for t, _ in times)
        t_hf = statistics.median(t for _, t in times)
        row = {
            "batch": batch,
            "beams": args.beams,
            "new tokens": args.new_tokens,
            "logitloop s": t_ours,
            "transformers s": t_hf,
            "speedup": t_hf / t_ours,
            "logitloop first call s (compiles)": warm_s,
            "same best sequences": [b[0].token_ids for b in found] == ref,
        }
        rows.append(row)
        for key, value in row.items():
            print(f"{key:36s} {value:.4g}" if isinstance(value, float) else f"{key:36s} {value}")
        print()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
