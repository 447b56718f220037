"""Long prompts: what a prompt pass holds and how long it takes, for the tree on the path.

    python scripts/bench_attention.py temp --model issue --tokens 1024 2048 4096 8192
    python scripts/bench_attention.py temp --model small --tokens 4096 16384 65536
    python scripts/bench_attention.py prefill --tokens 512 2048 8192 32768
    python scripts/bench_attention.py generate --tokens 32768     # peak RSS, wall time
    python scripts/bench_attention.py cost --model llama-40m --batch 8 --tokens 64 512
    python scripts/bench_attention.py short --batch 8 --tokens 64 512 --repeats 50

`temp`: XLA's `memory_analysis().temp_size_in_bytes` of a compiled prompt pass (batch 1, a
cache of as many slots as the prompt), compiled only, never run: the score matrices of the
one-einsum attention show here as T x S. Run it with `PYTHONPATH` at another checkout for
that tree's numbers (the script uses nothing but the model protocol).
`prefill`: seconds per prompt token of the jitted prompt pass (compile excluded; median of
`--repeats`), on the "small" model.
`generate`: `logitloop.generate` of one random prompt of `--tokens` tokens and
`--new-tokens` new ones on the "small" model with a context of 64K, the process's peak
resident memory (`resource.getrusage`) and the wall time, compilation included.

`cost`: XLA's `cost_analysis()` (flops, bytes accessed) and temporaries of a compiled
prompt pass of `--tokens` columns and of one decode step, both over a cache of the prompt
plus 128 slots, batch `--batch`: what the program does, which CPU wall time on shared
cores does not show reliably.

`short`: one layer's attention alone at llama-40m's heads (8 of 64), batch `--batch`, a
cache of T + 128 slots: the dispatch's choice against the one-einsum reference, both in
this process, call after call alternating (`--repeats` pairs; the median of the per-pair
ratios), so the machine's drifts fall on both.

Models: "issue" is issue 43's 2-layer Llama (hidden 512, 8 heads); "small" a 2-layer
Llama with hidden 256, 8 query and 2 key/value heads; "llama-40m" bench_generate's
(8 layers, hidden 512, 8 heads).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import median_time  # scripts/ is on the path when run as a script

import logitloop as ll
from logitloop.models import LlamaConfig, LlamaModel

MODELS = {
    "issue": dict(hidden=512, heads=8, kv_heads=8, ffn=1376),
    "small": dict(hidden=256, heads=8, kv_heads=2, ffn=688),
    "llama-40m": dict(hidden=512, heads=8, kv_heads=8, ffn=1376, layers=8, vocab=32000),
}
CONTEXT = 65536


def model_for(name: str, context: int = CONTEXT) -> LlamaModel:
    m = MODELS[name]
    config = LlamaConfig(
        vocab_size=m.get("vocab", 1024),
        hidden_size=m["hidden"],
        intermediate_size=m["ffn"],
        num_layers=m.get("layers", 2),
        num_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        head_dim=m["hidden"] // m["heads"],
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )
    return LlamaModel(config, rngs=nnx.Rngs(0))


def prompt_pass(model):
    """A jitted prompt pass: `(state, tokens [1, T], positions [1, T]) -> logits`."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions):
        m = nnx.merge(graphdef, state)
        return m(tokens, positions, m.init_cache(1, tokens.shape[1]))[0]

    return forward, state


def temp_bytes(model, tokens: int) -> int:
    forward, state = prompt_pass(model)
    spec = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    compiled = forward.lower(state, spec, spec).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def run_temp(args) -> list[dict]:
    model = model_for(args.model)
    rows = []
    for t in args.tokens:
        rows.append(dict(tokens=t, temp_bytes=temp_bytes(model, t)))
        print(f"T={t:>6}  temp {rows[-1]['temp_bytes'] / 2**20:10.1f} MiB", flush=True)
    return rows


def run_cost(args) -> list[dict]:
    model = model_for(args.model, context=4096)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache)

    rows = []
    for t in args.tokens:
        cache = jax.eval_shape(lambda t=t: model.init_cache(args.batch, t + 128))
        for name, cols in (("prompt", t), ("decode", 1)):
            spec = jax.ShapeDtypeStruct((args.batch, cols), jnp.int32)
            compiled = forward.lower(state, spec, spec, cache).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            row = dict(
                tokens=t,
                call=name,
                flops=float(cost.get("flops", 0)),
                bytes_accessed=float(cost.get("bytes accessed", 0)),
                temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
            )
            rows.append(row)
            print(
                f"T={t:>5} {name:7} flops {row['flops']:.4g}  bytes {row['bytes_accessed']:.4g}"
                f"  temp {row['temp_bytes'] / 2**20:.1f} MiB",
                flush=True,
            )
    return rows


def run_short(args) -> list[dict]:
    from logitloop.ops import attention

    rng = np.random.default_rng(0)
    rows = []
    for t in args.tokens:
        b, h, d, slots = args.batch, 8, 64, t + 128
        q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((b, h, slots, d)), jnp.float32) for _ in "kv")
        mask = attention.Mask(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        calls = {
            name: functools.partial(
                jax.jit(functools.partial(attention.attention, implementation=name)),
                q,
                k,
                v,
                mask,
                d**-0.5,
            )
            for name in ("auto", "reference")
        }
        times = {name: [] for name in calls}
        for _ in range(args.repeats + 1):  # the first pair compiles
            for name, call in calls.items():
                times[name].append(median_time(call, 1))
        ratios = [a / r for a, r in zip(times["auto"][1:], times["reference"][1:], strict=True)]
        row = dict(
            tokens=t,
            auto_ms=1e3 * float(np.median(times["auto"][1:])),
            reference_ms=1e3 * float(np.median(times["reference"][1:])),
            ratio=float(np.median(ratios)),
            ratio_quartiles=[float(x) for x in np.quantile(ratios, [0.25, 0.75])],
        )
        rows.append(row)
        print(
            f"T={t:>5} auto {row['auto_ms']:8.3f} ms  reference {row['reference_ms']:8.3f} ms"
            f"  auto/reference {row['ratio']:.3f} ({row['ratio_quartiles'][0]:.3f}-"
            f"{row['ratio_quartiles'][1]:.3f})",
            flush=True,
        )
    return rows


def run_prefill(args) -> list[dict]:
    model = model_for("small")
    forward, state = prompt_pass(model)
    rng = np.random.default_rng(0)
    rows = []
    for t in args.tokens:
        tokens = jnp.asarray(rng.integers(0, 1024, (1, t)), jnp.int32)
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        call = functools.partial(forward, state, tokens, positions)
        seconds = median_time(call, args.repeats, warmup=1)
        rows.append(dict(tokens=t, seconds=seconds, us_per_token=1e6 * seconds / t))
        print(f"T={t:>6}  {seconds:8.3f} s  {rows[-1]['us_per_token']:8.1f} us/token", flush=True)
    return rows


def run_generate(args) -> list[dict]:
    model = model_for("small")
    prompt = np.random.default_rng(0).integers(0, 1024, args.tokens[0]).tolist()
    params = ll.SamplingParams.create(batch_size=1, max_tokens=args.new_tokens, seed=0)
    start = time.perf_counter()
    out = ll.generate(model, [prompt], params, ignore_eos=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    row = dict(
        tokens=args.tokens[0],
        new_tokens=len(out.token_ids[0]),
        seconds=seconds,
        peak_rss_bytes=peak,
    )
    print(
        f"prompt {row['tokens']} + {row['new_tokens']} new: {seconds:.1f} s, "
        f"peak RSS {peak / 2**30:.2f} GiB"
    )
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("temp", "prefill", "generate", "cost", "short"))
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    modes = dict(
        temp=run_temp, prefill=run_prefill, generate=run_generate, cost=run_cost, short=run_short
    )
    rows = modes[args.mode](args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(mode=args.mode, args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
