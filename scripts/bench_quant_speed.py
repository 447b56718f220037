"""Decode speed of quantized weights: tokens/s at batch 1 and 8, float vs int8 vs int4, side
by side in one run, and XLA's bytes accessed per decode step.

tokens/s: `generate` of `--new-tokens` greedy tokens (ignore_eos) from 16-token prompts,
each format warmed up once (compilation), then `--repeats` rounds that time every
(format, batch) in turn; the median per pair, quoted as a ratio to float at that batch.

bytes per step: `cost_analysis()["bytes accessed"]` of the compiled one-token forward
(`decode_step_cost`: the model's call on `[B, 1]` tokens with a cache of `--context`
slots), the number a memory-bound GPU decode step's time follows. XLA:CPU's count is the
program's operands as it compiled them; a GPU build (fused dequantization, packed int4)
can differ, which only a device run shows (`scripts/device_check.py`'s quantized row).

Model: `--model shipped` (the shipped 4M-parameter model, int4 in groups of 32: 704 is not
divisible by 128) or `--model 1b` (a random Llama of Llama 3.2 1B's shapes, bytes only:
too slow to decode on this CPU), in `--dtype` (float32 default, bfloat16).

Run: PYTHONPATH=$PWD python scripts/bench_quant_speed.py [--model shipped] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import logitloop as ll
from logitloop.models import quantization

FORMATS = (None, "int8", "int4")


def decode_step_cost(model, batch: int, context: int) -> dict:
    """XLA's cost analysis of one decode step (one token per row at position context-1,
    all slots of a `context` cache live): bytes accessed and flops."""
    graphdef, state = nnx.split(model)

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache)

    cache = jax.eval_shape(lambda: model.init_cache(batch, context))
    tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    compiled = jax.jit(step).lower(state, tokens, tokens, cache).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"bytes": cost["bytes accessed"], "flops": cost["flops"]}


def load(name: str, fmt: str | None, dtype, group: int):
    group = group if fmt == "int4" else None  # int8 and fp8 scale per output channel
    if name == "shipped":
        return ll.load_pretrained(dtype=dtype, quantize=fmt, group_size=group)
    import bench_quant  # noqa: PLC0415 - a sibling script

    model = bench_quant.one_b_model(16)
    if dtype != jnp.bfloat16:
        raise SystemExit("--model 1b is built in bfloat16")
    if fmt is not None:
        quantization.quantize_model(model, quantization.check_quantize(fmt, group))
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("shipped", "1b"), default="shipped")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    models = {fmt: load(args.model, fmt, dtype, args.group_size) for fmt in FORMATS}
    names = {fmt: fmt or args.dtype for fmt in FORMATS}

    print(f"bytes accessed per decode step ({args.model}, {args.dtype}, context {args.context})")
    for batch in args.batches:
        costs = {fmt: decode_step_cost(m, batch, args.context) for fmt, m in models.items()}
        base = costs[None]["bytes"]
        text = ", ".join(
            f"{names[f]} {c['bytes'] / 2**20:.2f} MiB ({c['bytes'] / base:.3f}x)"
            for f, c in costs.items()
        )
        print(f"  B={batch}: {text}; params {quantization_bytes(models)}")
    if args.model == "1b":
        return

    rng = np.random.default_rng(0)
    vocab = models[None].config.vocab_size
    prompts = {b: rng.integers(3, vocab, (b, 16)).tolist() for b in args.batches}
    knobs = dict(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)

    def run(fmt, batch) -> float:
        start = time.perf_counter()
        result = ll.generate(models[fmt], prompts[batch], **knobs)
        took = time.perf_counter() - start
        assert sum(len(t) for t in result.token_ids) == batch * args.new_tokens
        return took

    for fmt in FORMATS:
        for batch in args.batches:
            run(fmt, batch)  # compile
    times = {(f, b): [] for f in FORMATS for b in args.batches}
    for _ in range(args.repeats):
        for key in times:
            times[key].append(run(*key))
    print(f"tokens/s, median of {args.repeats} after warm-up, {args.new_tokens} new tokens")
    for batch in args.batches:
        rate = {f: batch * args.new_tokens / statistics.median(times[f, batch]) for f in FORMATS}
        text = ", ".join(f"{names[f]} {rate[f]:.0f} ({rate[f] / rate[None]:.2f}x)" for f in FORMATS)
        print(f"  B={batch}: {text}")


def quantization_bytes(models) -> str:
    return ", ".join(
        f"{fmt or 'float'} {quantization.parameter_bytes(m) / 2**20:.2f} MiB"
        for fmt, m in models.items()
    )


if __name__ == "__main__":
    main()
