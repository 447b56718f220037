"""A paged pool on a mesh: replicated over the data axis (before) against one pool per data
shard (now), for one decode step of a whole model, per device.

    python scripts/bench_paged_mesh.py                      # a random 40M Llama, 8 CPU devices
    python scripts/bench_paged_mesh.py --size tiny --meshes 2x4

Runs on 8 simulated CPU devices (set before jax is imported). The KV budget is what
`--slots` contiguous slots of `--prompt-len + --max-tokens` tokens hold; the `--slots`
rows hold long-tailed lengths (`bench_paged_step.row_lengths`). For each mesh (data x
model) and layout, the model's forward pass of one token per row, jitted:

- replicated: the pool's heads over "model", its pages whole on every data shard, the
  tables' rows over "data", the layers reading the pool as one array (GSPMD partitions
  the gather);
- per shard: the pages over "data" too, each block of rows holding pages of its own
  block, the layers writing and reading per data shard (`layers.by_page_shard`).

Per device: the pool's bytes, XLA's `memory_analysis()` (arguments, temporaries),
`cost_analysis()` bytes accessed, and the bytes the step's collectives produce. These are
the properties a device pays (memory, HBM traffic, interconnect); a CPU's time is not.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_generate import MODELS, config  # noqa: E402 - scripts/ is on the path
from bench_paged_step import paged_cache, row_lengths, step_args  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from logitloop.decoding.loop import sharding  # noqa: E402
from logitloop.decoding.loop.runner import model_info  # noqa: E402
from logitloop.models import LlamaModel  # noqa: E402

COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.+?) "
    r"(?:all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\("
)
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo: str) -> int:
    """Bytes of every collective's result in a compiled module (per device)."""
    total = 0
    for line in hlo.splitlines():
        m = COLLECTIVE.match(line)
        if m:
            for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
                total += BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def compiled_step(info, row_mesh, keep: NamedSharding):
    """The model's forward pass, jitted, its rows over `row_mesh`'s data axis (None: the
    layers read the pool as one array); the pool stays at `keep`, as the decode loop's
    state does (`layout.state`)."""

    def forward(weights, tokens, positions, cache):
        logits, cache = info.runner.forward(weights, tokens, positions, cache, mesh=row_mesh)
        pools = [{k: layer[k] for k in ("k_pages", "v_pages")} for layer in cache]
        return logits, jax.lax.with_sharding_constraint(pools, keep)

    return jax.jit(forward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="llama-40m", choices=sorted(MODELS))
    ap.add_argument("--meshes", default="2x4,4x2,8x1")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=224)
    ap.add_argument("--median", type=float, default=16.0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    model = LlamaModel(config(args.size), rngs=nnx.Rngs(0))
    per_slot = args.prompt_len + args.max_tokens
    num_pages = args.slots * per_slot // args.page_size
    entries = -(-per_slot // args.page_size)
    rng = np.random.default_rng(args.seed)
    lengths = row_lengths(rng, args.slots, args.prompt_len, args.max_tokens, args.median)
    rows = []
    for name in args.meshes.split(","):
        d, m = (int(x) for x in name.split("x"))
        mesh = sharding.as_auto(jax.make_mesh((d, m), ("data", "model")))
        info = sharding.layout_for(mesh).place(model_info(model))
        block = num_pages // d
        # Each data shard's rows take pages of its own block (what `pages.allocate` does).
        tables = np.concatenate(
            [
                np.asarray(paged_cache(model, part, block, args.page_size, entries)[1])
                for part in np.split(lengths, d)
            ]
        )
        tables = np.where(
            tables >= 0, tables + np.repeat(np.arange(d), args.slots // d)[:, None] * block, -1
        )
        pool, _ = paged_cache(model, lengths[:1], num_pages, args.page_size, entries)
        heads = "model" if model.config.num_kv_heads % m == 0 else None
        for layout, spec, row_mesh in (
            ("replicated", P(heads), None),
            ("per shard", P(heads, "data"), mesh),
        ):
            placed = jax.device_put(pool, NamedSharding(mesh, spec))
            rows_over_data = NamedSharding(mesh, P("data"))
            tokens, positions, cache = step_args(info, lengths, placed, jnp.asarray(tables))
            tokens, positions = jax.device_put((tokens, positions), rows_over_data)
            cache = [dict(c, tables=jax.device_put(c["tables"], rows_over_data)) for c in cache]
            step = compiled_step(info, row_mesh, NamedSharding(mesh, spec))
            compiled = step.lower(info.weights, tokens, positions, cache).compile()
            memory = compiled.memory_analysis()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            shard = placed[0]["k_pages"].addressable_shards[0].data
            rows.append(
                dict(
                    mesh=name,
                    layout=layout,
                    pool_bytes_per_device=2 * len(placed) * shard.nbytes,
                    argument_bytes=memory.argument_size_in_bytes,
                    temp_bytes=memory.temp_size_in_bytes,
                    bytes_accessed=float(cost.get("bytes accessed", float("nan"))),
                    collective_bytes=collective_bytes(compiled.as_text()),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.size}, {args.slots} rows, pool {num_pages} pages of {args.page_size}")
    print(f"{'mesh':6} {'layout':11} {'pool/dev MB':>11} {'args MB':>8} {'temp MB':>8} "
          f"{'accessed MB':>11} {'collect. KB':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['mesh']:6} {r['layout']:11} {r['pool_bytes_per_device'] / 2**20:11.2f} "
            f"{r['argument_bytes'] / 2**20:8.2f} {r['temp_bytes'] / 2**20:8.2f} "
            f"{r['bytes_accessed'] / 2**20:11.2f} {r['collective_bytes'] / 2**10:11.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
