"""One decode step of a whole model at one KV memory budget: contiguous slots against pages.

    python scripts/bench_paged_step.py                       # a random 40M Llama
    python scripts/bench_paged_step.py --size tiny --repeats 20

The budget is what `--slots` contiguous slots of `--prompt-len + --max-tokens` tokens hold
(today's `generate_many`). The rows in flight hold a prompt of 4 to `--prompt-len` tokens
and part of an output whose length is long-tailed (lognormal, median `--median`, clipped to
`--max-tokens`): each row is somewhere in its output, uniformly. The same budget then holds:

- contiguous: `--slots` rows, each a cache of P + N slots;
- paged, same rows: those `--slots` rows in a pool of the budget's pages;
- paged, full pool: as many rows as the budget's pages hold at their current lengths.

For each, the model's forward pass of one token per row (the decode step's model part; the
sampler is the same for both layouts), jitted: XLA's `cost_analysis()` bytes accessed, in
all and per generated token (one per row), and the median time of `--repeats` calls after
a warm-up, the two same-row programs called in turn so that load on the machine falls on
both alike. On a CPU the time of a step grows with its rows; the bytes per token are the
property an accelerator's memory-bound decode step is paid by.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import MODELS, config  # scripts/ is on the path when run as a script
from flax import nnx

from logitloop.decoding.loop.runner import model_info
from logitloop.models import LlamaModel, layers


def row_lengths(rng, count: int, prompt_len: int, max_tokens: int, median: float) -> np.ndarray:
    """Tokens held by `count` rows in flight (module docstring)."""
    prompts = rng.integers(4, prompt_len + 1, count)
    outputs = np.clip(rng.lognormal(np.log(median), 1.0, count), 1, max_tokens)
    return prompts + np.floor(rng.uniform(0, 1, count) * outputs).astype(np.int64) + 1


def step_args(info, lengths: np.ndarray, cache, tables=None):
    """(tokens, positions, cache) of one decode step of rows with these lengths."""
    batch = len(lengths)
    tokens = jnp.ones((batch, 1), jnp.int32)
    positions = jnp.asarray(lengths - 1, jnp.int32)[:, None]
    if tables is not None:
        cache = [dict(layer, tables=tables) for layer in cache]
    return tokens, positions, cache


def paged_cache(model, lengths: np.ndarray, num_pages: int, page_size: int, entries: int):
    """A pool of `num_pages` pages and the rows' tables, each row's pages taken in turn."""
    c = model.config
    held = -(-lengths // page_size)
    tables = np.full((len(lengths), entries), -1, np.int32)
    start = np.concatenate([[0], np.cumsum(held)[:-1]])
    for b, (s, n) in enumerate(zip(start, held, strict=True)):
        tables[b, :n] = np.arange(s, s + n)
    none = jnp.zeros((0, 0), jnp.int32)
    pool = layers.init_paged_caches(
        c.num_layers, num_pages, page_size, none, c.num_kv_heads, c.head_dim, model.dtype
    )
    return [{k: v for k, v in layer.items() if k != "tables"} for layer in pool], jnp.asarray(
        tables
    )


def compiled_step(info, args):
    def step(weights, tokens, positions, cache):
        return info.runner.forward(weights, tokens, positions, cache)

    compiled = jax.jit(step).lower(info.weights, *args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return compiled, float(cost.get("bytes accessed", float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="llama-40m", choices=sorted(MODELS))
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--median", type=float, default=16.0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    model = LlamaModel(config(args.size), rngs=nnx.Rngs(0))
    info = model_info(model)
    rng = np.random.default_rng(args.seed)
    per_slot = args.prompt_len + args.max_tokens
    budget = args.slots * per_slot
    num_pages = budget // args.page_size
    entries = -(-per_slot // args.page_size)

    many = row_lengths(rng, 4 * budget // args.prompt_len, args.prompt_len, args.max_tokens,
                       args.median)  # fmt: skip
    pages_used = np.cumsum(-(-many // args.page_size))
    fleet = many[: int(np.searchsorted(pages_used, num_pages, side="right"))]
    same = fleet[: args.slots]

    contiguous = step_args(info, same, model.init_cache(args.slots, per_slot))
    pool, tables = paged_cache(model, same, num_pages, args.page_size, entries)
    paged_same = step_args(info, same, pool, tables)
    pool, tables = paged_cache(model, fleet, num_pages, args.page_size, entries)
    paged_full = step_args(info, fleet, pool, tables)

    rows = []
    programs = []
    for name, lengths, step in (
        ("contiguous", same, contiguous),
        ("paged, same rows", same, paged_same),
        ("paged, full pool", fleet, paged_full),
    ):
        compiled, nbytes = compiled_step(info, step)
        jax.block_until_ready(compiled(info.weights, *step))  # warm-up
        programs.append((compiled, step))
        rows.append(
            dict(
                layout=name,
                rows=len(lengths),
                tokens_held=int(np.sum(lengths)),
                bytes_accessed=nbytes,
                bytes_per_token=nbytes / len(lengths),
            )
        )
    times = [[] for _ in programs]
    for _ in range(args.repeats):  # in turn, so that the machine's load falls on each alike
        for i, (compiled, step) in enumerate(programs):
            t = time.perf_counter()
            jax.block_until_ready(compiled(info.weights, *step))
            times[i].append(time.perf_counter() - t)
    for row, ts in zip(rows, times, strict=True):
        row["median_s"] = float(np.median(ts))
        row["tokens_per_s"] = row["rows"] / row["median_s"]

    print(
        f"{args.size}, budget {budget} tokens of KV ({args.slots} slots of {per_slot}), "
        f"pages of {args.page_size}, {args.repeats} repeats"
    )
    print(f"{'layout':18} {'rows':>5} {'held':>6} {'MB accessed':>12} {'kB/token':>9} "
          f"{'step ms':>8} {'tokens/s':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['layout']:18} {r['rows']:5d} {r['tokens_held']:6d} "
            f"{r['bytes_accessed'] / 1e6:12.2f} {r['bytes_per_token'] / 1e3:9.1f} "
            f"{r['median_s'] * 1e3:8.2f} {r['tokens_per_s']:9.1f}"
        )
    base = rows[0]
    print(
        f"bytes per token, paged full pool / contiguous: "
        f"{rows[2]['bytes_per_token'] / base['bytes_per_token']:.2f}x; step time at "
        f"{args.slots} rows, paged / contiguous: {rows[1]['median_s'] / base['median_s']:.2f}x"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
