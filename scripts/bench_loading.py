"""Loading benchmark: converting a Hugging Face checkpoint against restoring the converted model.

    python scripts/bench_loading.py                      # llama-40m and llama-300m
    python scripts/bench_loading.py --sizes llama-40m --repeats 5 --out bench_out/loading.json

For each size, `transformers` writes a randomly initialised Llama checkpoint
(`save_pretrained`, float32 safetensors); then, in one run, median of `--repeats` after one
warm-up each:

- `convert`: `logitloop.load_pretrained(folder)`: read the safetensors tensor by tensor,
  transpose and reshape onto the NNX model;
- `restore`: `logitloop.models.restore_converted(dir)` of the same model written once by
  `save_converted` (Orbax).

Both are timed until every parameter is on the device, alternating convert and restore so
that both meet the same state of the machine. The restored parameters are
checked bit for bit against the converted ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import MODELS, transformers_llama  # scripts/ is on the path as a script
from flax import nnx

import logitloop as ll
from logitloop.models import restore_converted, save_converted

SIZES = {
    "llama-40m": MODELS["llama-40m"],  # the peer benchmark's model
    "llama-300m": dict(hidden=1024, layers=20, heads=16, kv_heads=8, ffn=2816, vocab=32000),
}


def write_checkpoint(name: str, folder: Path) -> int:
    hf = transformers_llama(SIZES[name], tie_word_embeddings=False)
    hf.save_pretrained(folder)
    return sum(p.numel() for p in hf.parameters())


def params_of(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def load_and_wait(load):
    model = load()
    jax.block_until_ready(params_of(model))
    return model


def run(name: str, repeats: int, workdir: Path) -> dict:
    folder = workdir / name / "hf"
    n_params = write_checkpoint(name, folder)
    convert = functools.partial(ll.load_pretrained, folder, dtype=jnp.float32)
    converted = load_and_wait(convert)
    target = workdir / name / "orbax"
    t0 = time.perf_counter()
    save_converted(converted, target)
    t_save = time.perf_counter() - t0
    restore = functools.partial(restore_converted, target)
    restored = load_and_wait(restore)  # warm-up
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(params_of(converted), params_of(restored), strict=True)
    )
    del converted, restored
    # Alternate the two, so that both see the same state of the machine and page cache.
    times: dict[str, list[float]] = {"convert": [], "restore": []}
    for _ in range(repeats):
        for kind, load in (("convert", convert), ("restore", restore)):
            t0 = time.perf_counter()
            model = load_and_wait(load)
            times[kind].append(time.perf_counter() - t0)
            del model
    t_convert = statistics.median(times["convert"])
    t_restore = statistics.median(times["restore"])
    size_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    return {
        "model": name,
        "parameters": n_params,
        "safetensors MB": round(size_mb, 1),
        "convert s": t_convert,
        "restore s": t_restore,
        "save s": t_save,
        "convert / restore": t_convert / t_restore,
        "bit-exact": bool(same),
        "times": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, args.repeats, Path(tmp)) for name in args.sizes]
    header = f"{'model':>11} {'params':>11} {'MB':>7} {'convert s':>9} {'restore s':>9} "
    print(header + f"{'convert/restore':>15} {'save s':>7} bit-exact")
    for r in rows:
        print(
            f"{r['model']:>11} {r['parameters']:>11,} {r['safetensors MB']:>7.1f} "
            f"{r['convert s']:>9.3f} {r['restore s']:>9.3f} {r['convert / restore']:>15.2f} "
            f"{r['save s']:>7.2f} {r['bit-exact']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"devices": str(jax.devices()), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
