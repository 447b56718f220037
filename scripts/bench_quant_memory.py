"""Peak host memory (RSS) while generating, float against quantized, and the decode program.

Writes a random Llama checkpoint in bfloat16 safetensors (`bench_quant_loading`'s writer;
default Llama 3.2 1B's shapes: hidden 2048, MLP 8192, 16 layers, 32/8 heads of 64,
vocabulary 128256, tied embedding), then per format, in a fresh subprocess, loads it in
`--dtype` (float32 default) with `ll.load_pretrained(path, dtype=..., quantize=...)` and
runs three `generate` calls (batch 1, a 16-token prompt, `--new-tokens` greedy tokens) and a
`generate_many` of 4 requests on 4 slots. Reported per format:

- resident memory (VmRSS) after loading, and the process's peak resident memory (VmHWM,
  reset after loading and again before `generate_many`, `/proc/self/clear_refs`) during
  the `generate` calls and during `generate_many`, as a ratio to the float model's
  (loading has its own peak: `bench_quant_loading.py`);
- decode tokens/s: the faster of the second and third `generate` (the first compiles), as
  a ratio to float (one process per format: on a shared machine, a rough ratio);
- XLA's view of the compiled decode `while_loop` of that call (`decode_loop.decode`,
  compiled again from its argument shapes after the peak is read): `memory_analysis()`
  temporaries (a float copy of every quantized weight shows here when XLA hoists the
  dequantization out of the loop) and `cost_analysis()` bytes accessed (the loop body
  once: one decode step).

Run: PYTHONPATH=$PWD python scripts/bench_quant_memory.py [--layers 16] [--formats float int8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
import logitloop as ll
from logitloop.decoding.engine import generate as generate_module
from logitloop.decoding.loop import decode_loop

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def reset_peak():  # VmHWM := VmRSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

path, fmt, dtype, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
shapes = {}
real_decode = generate_module.decode

def spy(program, tables, state, max_steps):  # records the decode loop's argument shapes
    shapes["args"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (tables, state, max_steps))
    shapes["program"] = program
    return real_decode(program, tables, state, max_steps)

generate_module.decode = spy
model = ll.load_pretrained(path, dtype=jnp.dtype(dtype), quantize=None if fmt == "float" else fmt)
jax.block_until_ready(jax.tree.leaves(model))
loaded = status("VmRSS")
reset_peak()
prompt = [[(7 * i) % 1000 + 3 for i in range(16)]]
knobs = dict(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
first = ll.generate(model, prompt, **knobs)
took = []
for _ in range(2):
    start = time.perf_counter()
    second = ll.generate(model, prompt, **knobs)
    took.append(time.perf_counter() - start)
took = min(took)
peak_generate = status("VmHWM")
reset_peak()
many = ll.generate_many(model, prompt * 4, slots=4, max_tokens=new_tokens, temperature=0.0,
                        ignore_eos=True)
peak_many = status("VmHWM")
compiled = decode_loop.decode.trace(shapes["program"], *shapes["args"]).lower().compile()
memory = compiled.memory_analysis()
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
print(json.dumps({
    "loaded": loaded, "peak_generate": peak_generate, "peak_many": peak_many,
    "tokens_per_s": new_tokens / took, "temp": memory.temp_size_in_bytes,
    "arguments": memory.argument_size_in_bytes, "bytes_accessed": cost["bytes accessed"],
    "tokens": second.token_ids[0], "same": first.token_ids == second.token_ids,
    "many_tokens": many[0].token_ids,
}))
"""


def main():
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_quant_loading  # noqa: PLC0415 - a sibling script: the checkpoint writer

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--formats", nargs="+", default=["float", "int8"])
    parser.add_argument("--checkpoint", help="a folder to keep the checkpoint in (reused)")
    args = parser.parse_args()
    gib = 2**30
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint or tmp)
        if not (folder / "model.safetensors").exists():
            folder.mkdir(parents=True, exist_ok=True)
            bench_quant_loading.write_checkpoint(
                folder, args.layers, args.hidden, args.mlp, args.vocab
            )
        base = None
        for fmt in args.formats:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(folder), fmt, args.dtype, str(args.new_tokens)],
                capture_output=True,
                text=True,
                cwd=tmp,
            )  # fmt: skip (cwd: the package comes from PYTHONPATH, not the current folder)
            if out.returncode:
                raise SystemExit(f"{fmt}: exit status {out.returncode}\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or r
            print(
                f"{fmt:6s}: RSS after load {r['loaded'] / gib:.2f} GiB, peak during generate "
                f"{r['peak_generate'] / gib:.2f} GiB "
                f"({r['peak_generate'] / base['peak_generate']:.2f}x), during generate_many "
                f"{r['peak_many'] / gib:.2f} GiB ({r['peak_many'] / base['peak_many']:.2f}x); "
                f"decode {r['tokens_per_s']:.2f} tok/s "
                f"({r['tokens_per_s'] / base['tokens_per_s']:.2f}x); decode program: temp "
                f"{r['temp'] / 2**20:.1f} MiB, arguments {r['arguments'] / gib:.2f} GiB, "
                f"bytes accessed {r['bytes_accessed'] / 2**20:.1f} MiB "
                f"({r['bytes_accessed'] / base['bytes_accessed']:.2f}x); "
                f"tokens {r['tokens'][:6]} (generate_many {r['many_tokens'][:6]})"
            )


if __name__ == "__main__":
    main()
