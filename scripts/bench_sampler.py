"""Sampler benchmark: logitloop.sample against sort-based pipelines and the softmax floor.

    python scripts/bench_sampler.py                      # the goal shape: batch 64, V 128256
    python scripts/bench_sampler.py --full               # batch 1/8/64/256 x V 32000/128256/151936
    python scripts/bench_sampler.py --out bench_out/sampler.json

In one run, for every shape and setting, each after a warm-up, median of `--repeats` calls:

- `logitloop`: `logitloop.sample` (jit-compiled; XLA path on CPU).
- `jax-sort`: the sort-based pipeline of the JAX samplers in use (Hugging Face Flax, Gemma,
  MaxText): penalties from dense counts, temperature, full sort, softmax, cumulative sum,
  top-k/top-p/min-p masks, `jax.random.categorical`.
- `torch-sort`: the same pipeline in PyTorch on the CPU (sort, softmax, cumsum, mask,
  multinomial), when torch is installed.
- `floor`: one `jax.nn.softmax` pass over the same logits.

Ratios are what to quote (machines are shared and noisy): `x floor` is a time over the floor
measured beside it, `x median floor` over the median of the floors measured for that shape,
`vs jax-sort` and `vs torch` are speedups of logitloop. Logits are peaked like a language
model's next-token distribution (normal * 4: the top-p 0.9 nucleus holds a few to a few
dozen tokens); the "wide" setting (temperature 1.5, top-p 0.99) keeps thousands of tokens
and exercises the path for large kept sets. The mean kept-set size is printed per setting.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time  # scripts/ is on the path when run as a script

import logitloop as ll

HISTORY = 1024

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "all": "per-row",  # every knob, different values in every row, penalties over history
    "wide": dict(temperature=1.5, top_p=0.99),
}


def knobs(setting: str, batch: int) -> dict:
    if setting != "all":
        return dict(SETTINGS[setting])
    r = np.random.default_rng(7)
    return dict(
        temperature=r.uniform(0.5, 1.2, batch).tolist(),
        top_k=r.integers(20, 100, batch).tolist(),
        top_p=r.uniform(0.8, 0.97, batch).tolist(),
        min_p=r.uniform(0.01, 0.1, batch).tolist(),
        repetition_penalty=r.uniform(1.0, 1.3, batch).tolist(),
        presence_penalty=r.uniform(0.0, 0.5, batch).tolist(),
        frequency_penalty=r.uniform(0.0, 0.5, batch).tolist(),
    )


def time_call(fn, repeats: int) -> float:
    return median_time(fn, repeats, warmup=2)  # the first call compiles


@jax.jit
def softmax_floor(logits):
    return jax.nn.softmax(logits, axis=-1)


@jax.jit
def jax_sort_pipeline(logits, history, temp, top_k, top_p, min_p, rep, pres, freq, key):
    """The sort-based sampler other JAX libraries use, with dense-count penalties."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    counts = jnp.zeros((batch, vocab), jnp.int32).at[rows, history].add(1)
    seen = counts > 0
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    x = x - freq[:, None] * counts - pres[:, None] * seen
    greedy = temp == 0
    x = x / jnp.where(greedy, 1.0, temp)[:, None]
    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sx, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (rank < jnp.where(top_k > 0, top_k, vocab)[:, None]) & (cum - probs < top_p[:, None])
    keep = keep & (probs >= min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    pick = jax.random.categorical(key, jnp.where(keep, sx, -jnp.inf), axis=-1)
    pick = jnp.where(greedy, 0, pick)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]


def torch_sort_pipeline(torch, logits, history, k):
    """The same pipeline in PyTorch (CPU)."""
    batch, vocab = logits.shape
    counts = torch.zeros((batch, vocab), dtype=torch.float32)
    counts.scatter_add_(1, history, torch.ones_like(history, dtype=torch.float32))
    seen = counts > 0
    rep = k["rep"][:, None]
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - k["freq"][:, None] * counts - k["pres"][:, None] * seen
    greedy = k["temp"] == 0
    x = x / torch.where(greedy, torch.ones_like(k["temp"]), k["temp"])[:, None]
    sx, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sx, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    rank = torch.arange(vocab)[None, :]
    top_k = torch.where(k["top_k"] > 0, k["top_k"], torch.full_like(k["top_k"], vocab))
    keep = (rank < top_k[:, None]) & (cum - probs < k["top_p"][:, None])
    keep &= probs >= k["min_p"][:, None] * probs[:, :1]
    keep[:, 0] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    pick = torch.multinomial(probs, 1)[:, 0]
    pick = torch.where(greedy, torch.zeros_like(pick), pick)
    return order.gather(1, pick[:, None])[:, 0]


def run(batch: int, vocab: int, setting: str, repeats: int, torch) -> dict:
    rng = np.random.default_rng(batch * 7 + vocab)
    logits_np = (rng.standard_normal((batch, vocab)) * 4.0).astype(np.float32)
    history_np = rng.integers(0, vocab, (batch, HISTORY)).astype(np.int32)
    kn = knobs(setting, batch)
    params = ll.SamplingParams.create(batch_size=batch, seed=list(range(batch)), **kn)
    logits = jnp.asarray(logits_np)
    positions = jnp.full((batch,), 5, jnp.int32)
    penalties = setting == "all"
    hist = None
    if penalties:
        prompt, generated = history_np[:, : HISTORY // 2], history_np[:, HISTORY // 2 :]
        hist = ll.History.create(prompt.tolist(), vocab_size=vocab, capacity=HISTORY // 2)
        hist = hist.replace(
            tokens=hist.tokens.at[:, HISTORY // 2 :].set(jnp.asarray(generated)),
            length=hist.length + HISTORY // 2,
        )
    result = {"batch": batch, "vocab": vocab, "setting": setting}
    result["floor"] = time_call(lambda: softmax_floor(logits), repeats)
    result["logitloop"] = time_call(lambda: ll.sample(logits, params, positions, hist), repeats)
    probs = ll.sampling_distribution(logits, params, positions, hist)
    result["kept_mean"] = float(jnp.mean(jnp.sum(probs > 0, axis=1)))

    d = params.device_only()
    zeros = jnp.zeros((batch,), jnp.float32)
    ones = jnp.ones((batch,), jnp.float32)
    sort_args = (
        logits,
        jnp.asarray(history_np) if penalties else jnp.zeros((batch, 1), jnp.int32),
        d.temperature,
        d.top_k,
        d.top_p,
        d.min_p,
        d.repetition_penalty if penalties else ones,
        d.presence_penalty if penalties else zeros,
        d.frequency_penalty if penalties else zeros,
        jax.random.key(0),
    )
    result["jax-sort"] = time_call(lambda: jax_sort_pipeline(*sort_args), max(3, repeats // 2))
    if torch is not None:
        t = {
            "temp": torch.tensor(np.asarray(d.temperature)),
            "top_k": torch.tensor(np.asarray(d.top_k)).long(),
            "top_p": torch.tensor(np.asarray(d.top_p)),
            "min_p": torch.tensor(np.asarray(d.min_p)),
            "rep": torch.tensor(np.asarray(sort_args[6])),
            "pres": torch.tensor(np.asarray(sort_args[7])),
            "freq": torch.tensor(np.asarray(sort_args[8])),
        }
        tl = torch.tensor(logits_np)
        th = torch.tensor(np.asarray(sort_args[1])).long()
        with torch.inference_mode():
            result["torch-sort"] = time_call(
                lambda: torch_sort_pipeline(torch, tl, th, t), max(3, repeats // 2)
            )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every batch and vocabulary size")
    ap.add_argument("--batch", type=int, nargs="*", default=None)
    ap.add_argument("--vocab", type=int, nargs="*", default=None)
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    batches = args.batch or ([1, 8, 64, 256] if args.full else [64])
    vocabs = args.vocab or ([32000, 128256, 151936] if args.full else [128256])
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {platform.processor()}")
    header = (
        f"{'batch':>5} {'vocab':>6} {'setting':>11} {'kept':>7} {'floor ms':>9} "
        f"{'logitloop ms':>12} {'x floor':>8} {'vs jax-sort':>11} {'vs torch':>9}"
    )
    print(header)
    rows = []
    for v in vocabs:
        for b in batches:
            shape_rows = []
            for s in args.settings:
                r = run(b, v, s, args.repeats, torch)
                rows.append(r)
                shape_rows.append(r)
                vs_torch = r["torch-sort"] / r["logitloop"] if "torch-sort" in r else float("nan")
                print(
                    f"{b:>5} {v:>6} {s:>11} {r['kept_mean']:>7.1f} {1e3 * r['floor']:>9.2f} "
                    f"{1e3 * r['logitloop']:>12.2f} {r['logitloop'] / r['floor']:>8.2f} "
                    f"{r['jax-sort'] / r['logitloop']:>11.1f} {vs_torch:>9.1f}",
                    flush=True,
                )
            # The floor is the same computation for every setting of a shape; its median over
            # them is steadier than one measurement (page faults, other tenants).
            med = statistics.median(r["floor"] for r in shape_rows)
            for r in shape_rows:
                r["median floor"] = med
                r["x median floor"] = r["logitloop"] / med
            ratios = ", ".join(f"{r['setting']} {r['x median floor']:.2f}x" for r in shape_rows)
            print(f"      median floor {1e3 * med:.2f} ms; x median floor: {ratios}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"jax": jax.__version__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
