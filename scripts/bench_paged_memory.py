"""Device memory a `generate_many` job holds: contiguous slots against one paged pool.

    python scripts/bench_paged_memory.py                 # a random tiny Llama, 64 prompts
    python scripts/bench_paged_memory.py --size llama-40m  # a random 40M Llama (32 kB KV/token)

Output lengths follow a long-tailed distribution (lognormal, median `--median` tokens,
clipped to `--max-tokens`). Two jobs over the same requests:

- contiguous: `--slots` rows, each a cache of `P + N` slots (today's default);
- paged: `--paged-slots` rows sharing `kv_cache_tokens` (default: what the contiguous job's
  cache holds) in pages of `--page-size`;
- paged/4: `--slots` rows sharing a quarter of that.

For each: the device bytes held while the job runs (the sum of `jax.live_arrays()` sizes,
sampled as each request completes, less what was live before the job and less the job's
own copy of the weights, which `generate_many` places on the device), the
KV cache's own bytes, generated tokens, tokens/s (after a warm-up run), and held KV bytes
per token in flight. The tokens of the two jobs are compared (expected equal).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import MODELS, config  # scripts/ is on the path when run as a script
from flax import nnx

from logitloop.decoding.engine.batching import Request, iter_generate_many
from logitloop.decoding.engine.host import MIN_BUFFER_BUCKET, MIN_PROMPT_BUCKET, bucket
from logitloop.models import LlamaModel


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def run(model, weights, requests, bounds, **kwargs):
    """Token ids per request, peak live bytes above the start, seconds, stats."""
    stats: dict = {}
    start = live_bytes()
    peak = 0
    out = {}
    t = time.perf_counter()
    for index, result in iter_generate_many(model, requests, **bounds, **kwargs, stats=stats):
        out[index] = result.token_ids[0]
        peak = max(peak, live_bytes() - start - weights)
    seconds = time.perf_counter() - t
    return [out[i] for i in range(len(out))], peak, seconds, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--paged-slots", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-tokens", type=int, default=0)
    ap.add_argument("--median", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="tiny", choices=sorted(MODELS), help="random Llama's size")
    args = ap.parse_args()

    model = LlamaModel(config(args.size), dtype=jnp.float32, rngs=nnx.Rngs(0))
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    c = model.config
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(
        rng.lognormal(np.log(args.median), 1.0, args.prompts).astype(int), 1, args.max_tokens
    )
    requests = [
        Request(
            rng.integers(0, c.vocab_size, int(rng.integers(4, 33))).tolist(),
            dict(temperature=0.8, seed=i, max_tokens=int(n)),
        )
        for i, n in enumerate(lengths)
    ]
    bounds = dict(
        max_prompt_len=32, max_tokens_bound=args.max_tokens, chunk_steps=8, ignore_eos=True
    )
    cap = bucket(32, MIN_PROMPT_BUCKET) + bucket(args.max_tokens, MIN_BUFFER_BUCKET)
    kv_tokens = args.kv_cache_tokens or args.slots * cap
    token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # float32 K and V
    jobs = {
        "contiguous": dict(slots=args.slots),
        "paged": dict(slots=args.paged_slots, kv_cache_tokens=kv_tokens, page_size=args.page_size),
        "paged/4": dict(slots=args.slots, kv_cache_tokens=kv_tokens // 4, page_size=args.page_size),
    }
    print(
        f"{args.prompts} prompts of 4-32 tokens, output lengths lognormal (median "
        f"{args.median}, mean {lengths.mean():.1f}, max {lengths.max()}); "
        f"KV {token_bytes} bytes per token; weights {weights / 1e6:.1f} MB"
    )
    results = {}
    for name, kwargs in jobs.items():
        run(model, weights, requests[: 2 * args.slots], bounds, **kwargs)  # compiles
        results[name] = run(model, weights, requests, bounds, **kwargs)
    print(
        f"\n{'job':<12}{'slots':>6}{'KV tokens':>10}{'KV MB':>8}{'held MB':>9}"
        f"{'tokens':>8}{'B/token':>9}{'tokens/s':>10}{'in flight':>10}{'preempted':>10}"
    )
    for name, kwargs in jobs.items():
        ids, peak, seconds, stats = results[name]
        kv = kwargs.get("kv_cache_tokens", args.slots * cap)
        tokens = sum(len(x) for x in ids)
        print(
            f"{name:<12}{kwargs['slots']:>6}{kv:>10}{kv * token_bytes / 1e6:>8.2f}"
            f"{peak / 1e6:>9.2f}{tokens:>8}{peak / tokens:>9.0f}{tokens / seconds:>10.1f}"
            f"{stats.get('most_rows_in_flight', kwargs['slots']):>10}"
            f"{stats.get('preemptions', 0):>10}"
        )
    paged_peak = results["paged"][1]
    print(
        f"\npaged: held {paged_peak / (kv_tokens * token_bytes):.2f}x the pool's "
        f"{kv_tokens} tokens of KV (goal <= 1.2x, besides the weights)"
    )
    differ = sum(a != b for a, b in zip(results["paged"][0], results["contiguous"][0], strict=True))
    print(f"requests whose tokens differ, paged against contiguous: {differ} of {args.prompts}")


if __name__ == "__main__":
    main()
