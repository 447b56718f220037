"""Packed scoring at real size: `ll.score` against a padded batched forward in transformers.

    python scripts/bench_packed.py [--pairs 64] [--layers 16] [--repeats 3] [--json out.json]

A random Llama-3.2-1B-shaped checkpoint (hidden 2048, 32 heads, 8 KV heads, MLP 8192,
vocabulary 128256; `--layers` of them, 16 in the real model), written by transformers in
float32 and loaded by logitloop. The job: `--pairs` (context, continuation) pairs, contexts
of 10 to `--longest` tokens, continuations of 1 to 12.

- logitloop: `ll.score(model, contexts, continuations)`: packed passes by token budget
  (docs/scoring.md), counted programs (`CompileWatch`) on the first call.
- transformers: lm-evaluation-harness's `hf` loglikelihood loop: pairs sorted by length,
  batches of `--batch`, each row context + continuation right-padded to the batch's
  longest, one forward pass, log_softmax, the continuation's tokens gathered.

Also, without running anything: the tokens each side computes (the packed passes' buckets
against the padded batches), the algorithmic part of the difference. The two alternate
repeat by repeat after one untimed warm-up each; the table gives scored tokens per second
(median) and the ratio, and the largest difference of the per-pair sums.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.decoding.engine import packed, reuse  # noqa: E402
from logitloop.decoding.runtime.compiles import CompileWatch  # noqa: E402


def make_model(layers: int, folder: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
        rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return hf


def make_pairs(n: int, longest: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ctx = [rng.integers(3, 128000, size=int(rng.integers(10, longest + 1))).tolist()
           for _ in range(n)]  # fmt: skip
    cont = [rng.integers(3, 128000, size=int(rng.integers(1, 13))).tolist() for _ in range(n)]
    return ctx, cont


def hf_scores(hf, ctx, cont, batch: int) -> list[float]:
    """lm-eval's `hf` loglikelihood: longest first, right-padded batches."""
    import torch

    order = sorted(range(len(ctx)), key=lambda i: -(len(ctx[i]) + len(cont[i])))
    out = [0.0] * len(ctx)
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            rows = order[s : s + batch]
            seqs = [(ctx[i] + cont[i])[:-1] for i in rows]
            width = max(len(q) for q in seqs)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            for r, q in enumerate(seqs):
                ids[r, : len(q)] = torch.tensor(q)
            logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)
            for r, i in enumerate(rows):
                c, n = cont[i], len(ctx[i])
                pos = torch.arange(n - 1, n - 1 + len(c))
                out[i] = float(logp[r, pos, torch.tensor(c)].sum())
    return out


def tokens_computed(ctx, cont, batch: int, budget: int) -> tuple[int, int, int]:
    """(real tokens, the packed passes' token slots, the padded batches' token slots)."""
    real = sum(len(a) + len(b) - 1 for a, b in zip(ctx, cont, strict=True))
    order = sorted(range(len(ctx)), key=lambda i: -(len(ctx[i]) + len(cont[i])))
    passes = packed.split_passes(ctx, cont, order, budget, 16, None, True)
    slots = 0
    for rows in passes:
        shape = packed.pack([ctx[r] for r in rows], [cont[r] for r in rows]).shape
        slots += shape.prompt_tokens + shape.cont_tokens
    padded = 0
    for s in range(0, len(order), batch):
        rows = order[s : s + batch]
        padded += len(rows) * max(len(ctx[i]) + len(cont[i]) - 1 for i in rows)
    return real, slots, padded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--longest", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ctx, cont = make_pairs(args.pairs, args.longest)
    real, slots, padded = tokens_computed(ctx, cont, args.batch, packed.TOKEN_BUDGET)
    print(f"tokens: {real} real; packed passes compute {slots} ({slots / real:.2f}x), "
          f"padded batches of {args.batch} {padded} ({padded / real:.2f}x)")  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="bench_packed_"))
    hf = make_model(args.layers, folder)
    model = ll.load_pretrained(folder)
    reuse.forget()
    with CompileWatch() as watch:
        t0 = time.perf_counter()
        got = ll.score(model, ctx, cont)
        first = time.perf_counter() - t0
    want = hf_scores(hf, ctx, cont, args.batch)
    diff = max(abs(g.raw_logprob_sum - w) for g, w in zip(got, want, strict=True))
    scored = sum(len(c) for c in cont)
    times = {"logitloop": [], "transformers": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ll.score(model, ctx, cont)
        times["logitloop"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_scores(hf, ctx, cont, args.batch)
        times["transformers"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.pairs} pairs, {args.layers} layers: first call {first:.1f} s, "
          f"{watch.count} programs ({watch.seconds:.1f} s compiling)")  # fmt: skip
    for k, v in med.items():
        print(f"  {k:13s} {v:8.2f} s  {scored / v:8.1f} scored tokens/s")
    ratio = med["transformers"] / med["logitloop"]
    print(f"  ratio (transformers time / logitloop time): {ratio:.2f}x; largest difference "
          f"of a pair's sum {diff:.2e}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({
            "pairs": args.pairs, "layers": args.layers, "programs": watch.count,
            "compile_s": watch.seconds, "median_s": med, "max_diff": diff,
            "tokens": {"real": real, "packed": slots, "padded": padded},
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
