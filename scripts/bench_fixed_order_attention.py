"""The fixed-order attention (the deterministic modes') by query block size, one layer.

    python scripts/bench_fixed_order_attention.py [--repeats 5] [--json out.json]

One layer's attention at lm-eval lengths on the shipped model's head shape: `--batch` rows
of `--tokens` tokens left-padded to a prompt pass of `--columns` columns over a cache of
`--columns + 16` slots (the bucket and the decode buffer), 2 KV heads x 2, head_dim 64,
float32, causal. Query blocks of `--blocks` sizes (the largest covering the whole pass:
one block, every chunk any query of the call sees computed, as before query blocks)
run side by side, median of `--repeats` after a warm-up; each output is checked bit for
bit against the one-block run. "chunk products" counts the (block, key chunk) pairs whose
products run, times the block's columns: the work the `lax.cond`s let through, which
XLA's cost analysis cannot show (it counts a loop body once, taken or not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from logitloop.models import fixed_order  # noqa: E402
from logitloop.ops.attention import fixed_order as attention_mod  # noqa: E402

MASK_VALUE = float(np.finfo(np.float32).min)


def inputs(batch, columns, tokens, hkv=2, g=2, d=64, seed=0):
    rng = np.random.default_rng(seed)
    slots = columns + 16
    q = rng.standard_normal((batch, columns, hkv, g, d)).astype(np.float32)
    k, v = (rng.standard_normal((batch, hkv, slots, d)).astype(np.float32) for _ in "kv")
    first = columns - tokens  # left padding: the tokens sit in slots first..columns-1
    col = np.arange(columns)[:, None]
    slot = np.arange(slots)[None, :]
    mask = (slot >= first) & (slot <= col) & (col >= first)
    return q, k, v, np.broadcast_to(mask, (batch, columns, slots))


def chunk_products(mask: np.ndarray, block: int) -> int:
    """Query columns x key chunks whose products run with query blocks of `block`."""
    b, t, s = mask.shape
    rows = min(t, block)
    blocks = -(-t // rows)
    chunks = -(-s // attention_mod.SLOT_CHUNK)
    m = np.zeros((b, blocks * rows, chunks * attention_mod.SLOT_CHUNK), bool)
    m[:, :t, :s] = mask
    live = m.reshape(b, blocks, rows, chunks, -1).any(axis=(0, 2, 4))
    return int(live.sum()) * rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--columns", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=343)
    ap.add_argument("--blocks", default="512,128,64,32", help="query block sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    q, k, v, mask = inputs(args.batch, args.columns, args.tokens)
    sizes = [int(s) for s in args.blocks.split(",")]
    fns = {}
    for size in sizes:
        attention_mod.QUERY_BLOCK = size  # read at trace time
        fn = jax.jit(
            lambda q, k, v, m: attention_mod.fixed_order_attention(
                q, k, v, m, lambda s, m: jnp.where(m, s * 0.125, MASK_VALUE)
            ),
            compiler_options=fixed_order.compiler_options(),
        )
        start = time.perf_counter()
        fns[size] = fn.lower(q, k, v, mask).compile()
        compile_s = time.perf_counter() - start
        fns[size] = (fns[size], compile_s)
    ref = np.asarray(fns[sizes[0]][0](q, k, v, mask))
    times = {s: [] for s in sizes}
    for size in sizes:  # warm-up, and the bits
        out = np.asarray(fns[size][0](q, k, v, mask))
        first = args.columns - args.tokens  # padding columns see nothing: not compared
        assert np.array_equal(out[:, first:], ref[:, first:]), size
    for _ in range(args.repeats):
        for size in sizes:
            start = time.perf_counter()
            fns[size][0](q, k, v, mask).block_until_ready()
            times[size].append(time.perf_counter() - start)
    full = chunk_products(mask, sizes[0])
    base = statistics.median(times[sizes[0]])
    results = {}
    print(f"[{args.batch}, {args.columns}] queries, {args.tokens} tokens left-padded, "
          f"{args.columns + 16} slots; bits equal to the one-block run: yes")  # fmt: skip
    print(f"{'block':>6}{'ms':>9}{'speed-up':>10}{'chunk products':>16}{'compile s':>11}")
    for size in sizes:
        ms = statistics.median(times[size]) * 1e3
        work = chunk_products(mask, size)
        results[size] = {"ms": ms, "chunk_products": work, "compile_s": fns[size][1]}
        print(f"{size:>6}{ms:>9.1f}{base * 1e3 / ms:>9.2f}x{work / full:>15.2f}x"
              f"{fns[size][1]:>11.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
