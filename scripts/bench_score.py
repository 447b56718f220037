"""Scoring benchmark: `ll.score` against transformers on a multiple-choice-style job, on CPU.

    python scripts/bench_score.py
    python scripts/bench_score.py --questions 32 --choices 4 --prompt 64 --repeats 5

The job: `questions` prompts of `--prompt` random tokens, each with `choices` continuations
of 1 to `--max-choice` tokens (the lm-evaluation-harness multiple-choice shape: every
choice scored given the question). The model is bench_generate's ~40M-parameter Llama
(random, float32), written by transformers and loaded by logitloop.

- logitloop: `ll.score(model, prompts, continuations, batch_size=B)`.
- transformers: what lm-evaluation-harness's `loglikelihood` does with a HF model: batches
  of B pairs, each row prompt + continuation right-padded, one forward pass, log_softmax
  over the vocabulary, the continuation's tokens gathered and summed (PyTorch CPU,
  inference mode); and the same with the LM head and log_softmax over the continuation's
  positions only (as logitloop does), to show what that part of the difference is worth.

The two alternate, repeat by repeat, after one untimed warm-up each (logitloop's compiles);
the table gives pairs per second (median) and the ratio, and the largest difference of the
per-pair sums between the two.
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


def make_job(questions: int, choices: int, prompt: int, max_choice: int, vocab: int, seed=0):
    rng = np.random.default_rng(seed)
    prompts, conts = [], []
    for _ in range(questions):
        q = rng.integers(1, vocab, prompt).tolist()
        for _ in range(choices):
            prompts.append(q)
            conts.append(rng.integers(1, vocab, int(rng.integers(1, max_choice + 1))).tolist())
    return prompts, conts


def transformers_scores(hf, prompts, conts, batch: int, head_all: bool = True) -> list[float]:
    """lm-evaluation-harness's loop (`head_all`: the LM head and log_softmax over every
    position, as it does), or with the head over the continuation positions only."""
    import torch

    sums = []
    for start in range(0, len(prompts), batch):
        ps, cs = prompts[start : start + batch], conts[start : start + batch]
        rows = [p + c for p, c in zip(ps, cs, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        if head_all:
            logp = torch.log_softmax(hf(ids, attention_mask=mask).logits.float(), dim=-1)
        else:
            hidden = hf.model(ids, attention_mask=mask).last_hidden_state
        for i in range(len(rows)):
            p, c = prompts[start + i], conts[start + i]
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            if head_all:
                sums.append(float(logp[i, pos, torch.tensor(c)].sum()))
            else:
                lp = torch.log_softmax(hf.lm_head(hidden[i, pos]).float(), dim=-1)
                sums.append(float(lp[torch.arange(len(c)), torch.tensor(c)].sum()))
    return sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-choice", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    hf, model = peer_pair("llama-40m")
    prompts, conts = make_job(
        args.questions, args.choices, args.prompt, args.max_choice, hf.config.vocab_size
    )

    def ours():
        return [s.raw_logprob_sum for s in ll.score(model, prompts, conts, batch_size=args.batch)]

    def theirs():
        with torch.inference_mode():
            return transformers_scores(hf, prompts, conts, args.batch)

    def theirs_head():
        with torch.inference_mode():
            return transformers_scores(hf, prompts, conts, args.batch, head_all=False)

    t0 = time.perf_counter()
    ours_sums = ours()
    warm_s = time.perf_counter() - t0
    theirs_sums = theirs()
    head_sums = theirs_head()
    times = []
    for _ in range(args.repeats):  # alternate: all see the same state of the shared machine
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        theirs()
        t2 = time.perf_counter()
        theirs_head()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    t_ours = statistics.median(t[0] for t in times)
    t_hf = statistics.median(t[1] for t in times)
    t_head = statistics.median(t[2] for t in times)
    pairs = len(prompts)
    row = {
        "pairs": pairs,
        "batch": args.batch,
        "prompt tokens": args.prompt,
        "logitloop pairs/s": pairs / t_ours,
        "transformers pairs/s": pairs / t_hf,
        "speedup": t_hf / t_ours,
        "transformers (head on continuation) pairs/s": pairs / t_head,
        "speedup over it": t_head / t_ours,
        "logitloop first call s (compiles)": warm_s,
        "max |sum difference|": float(np.max(np.abs(np.subtract(ours_sums, theirs_sums)))),
        "max |sum difference| (head variant)": float(
            np.max(np.abs(np.subtract(ours_sums, head_sums)))
        ),
        "torch threads": torch.get_num_threads(),
    }
    for key, value in row.items():
        print(f"{key:44s} {value:.4g}" if isinstance(value, float) else f"{key:44s} {value}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
