"""Decode attention over a long, mostly empty KV cache: contiguous buffer against pages.

    python scripts/bench_paged_attention.py
    python scripts/bench_paged_attention.py --rows 32 --slots 4096 --out bench_out/paged.json

One layer of a Llama-3-8B-like model (32 query heads, 8 KV heads of 128, bfloat16), `--rows`
rows whose lengths follow a long-tailed distribution (log-normal, median `--median`,
clipped to [1, `--slots`]), one decode step (one query per row). For each way of holding
the cache, XLA's own accounting of the jitted step on this CPU: `cost_analysis()` bytes
accessed and `memory_analysis()` argument bytes (the cache the step is handed), plus the
best of `--repeats` CPU times as a ratio to the contiguous step:

- contiguous: today's `[B, Hkv, S, D]` buffer and `layers._attend` over all S slots;
- contiguous, prefix: `layers.attend`, which reads S/8, S/4, S/2 or S slots (a switch;
  XLA's cost analysis of a conditional is reported as XLA gives it);
- paged, full table: a pool holding only the rows' pages (`paged_attention_reference`,
  the XLA path), each row's table `S / page_size` entries long;
- paged, live table: the same with tables cut to the longest row's pages (what a loop
  that sizes its tables to the current extent would run).
- paged, XLA path: `paged_attention(backend="xla")`, the reference over the shortest of
  P/8, P/4, P/2 or P table entries that holds every row's pages (a switch, as above).

The Pallas kernel reads only each row's live pages; its bytes are computed from the
lengths (no GPU here), not measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.models import layers
from logitloop.ops.attention import paged

H, HKV, D = 32, 8, 128
DTYPE = jnp.bfloat16


def _measure(fn, args, repeats):
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "seconds": min(times),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--median", type=float, default=200.0)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    b, s, ps = args.rows, args.slots, args.page_size
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median), 1.0, b)), 1, s).astype(np.int32)
    live = -(-lengths // ps)
    num_pages = int(live.sum())
    q = jnp.asarray(rng.standard_normal((b, 1, H, D)), DTYPE)

    k = jnp.asarray(rng.standard_normal((b, HKV, s, D)), DTYPE)
    mask = jnp.asarray(np.arange(s)[None, None, :] < lengths[:, None, None])  # [B, 1, S]
    scale = D**-0.5
    results = {
        "contiguous": _measure(
            lambda q, k, v, m: layers._attend(q, k, v, m, scale), (q, k, k, mask), args.repeats
        ),
        "contiguous, prefix": _measure(
            lambda q, k, v, m: layers.attend(q, k, v, m, scale), (q, k, k, mask), args.repeats
        ),
    }
    del k

    pool = jnp.asarray(rng.standard_normal((HKV, num_pages, ps, D)), DTYPE)
    order = rng.permutation(num_pages)
    tables = np.zeros((b, s // ps), np.int32)
    start = np.concatenate([[0], np.cumsum(live)[:-1]])
    for row in range(b):
        tables[row, : live[row]] = order[start[row] : start[row] + live[row]]
    lengths_j = jnp.asarray(lengths)

    def paged_step(q, kp, vp, t, n):
        return paged.paged_attention_reference(q[:, 0], kp, vp, t, n, scale=scale)

    for name, width in (("paged, full table", s // ps), ("paged, live table", int(live.max()))):
        t = jnp.asarray(tables[:, :width])
        results[name] = _measure(paged_step, (q, pool, pool, t, lengths_j), args.repeats)
    results["paged, XLA path"] = _measure(
        lambda q, kp, vp, t, n: paged.paged_attention(q[:, 0], kp, vp, t, n, backend="xla"),
        (q, pool, pool, jnp.asarray(tables), lengths_j),
        args.repeats,
    )

    kv_bytes_per_token = 2 * HKV * D * jnp.dtype(DTYPE).itemsize  # K and V, one layer
    kernel_bytes = float(live.sum() * ps * kv_bytes_per_token + q.nbytes + tables.nbytes)
    base = results["contiguous"]["seconds"]
    print(
        f"{b} rows, lengths median {int(np.median(lengths))}, mean {lengths.mean():.0f}, "
        f"max {lengths.max()} of {s} slots; page size {ps}; one layer, {DTYPE.__name__}"
    )
    print(f"{'layout':<22}{'bytes accessed':>16}{'cache bytes':>14}{'CPU time':>10}")
    for name, r in results.items():
        print(
            f"{name:<22}{r['bytes_accessed'] / 2**20:>13.1f} MB{r['argument_bytes'] / 2**20:>11.1f}"
            f" MB{r['seconds'] / base:>9.2f}x"
        )
    print(f"{'paged, Pallas kernel':<22}{kernel_bytes / 2**20:>13.1f} MB   (computed: live pages)")
    used = lengths.sum() * kv_bytes_per_token
    held = {"contiguous": b * s * kv_bytes_per_token, "paged": num_pages * ps * kv_bytes_per_token}
    print(
        f"KV held per layer: contiguous {held['contiguous'] / 2**20:.1f} MB, paged "
        f"{held['paged'] / 2**20:.1f} MB (tokens' own KV {used / 2**20:.1f} MB; paged waste "
        f"{1 - used / held['paged']:.1%}, contiguous waste {1 - used / held['contiguous']:.1%})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "lengths": lengths.tolist(),
            "page_size": ps,
            "results": results,
            "kernel_bytes_computed": kernel_bytes,
            "held_bytes": held,
            "used_bytes": int(used),
        }
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
