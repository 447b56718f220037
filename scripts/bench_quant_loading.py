"""Peak host memory (RSS) while loading a checkpoint: float against quantized while loading.

Writes a random Llama checkpoint in bfloat16 safetensors (Hugging Face names; default
hidden 1024, MLP 4096, 16 layers, 16/8 heads of 64, vocabulary 32000, tied embedding:
about 273M parameters, 0.55 GB), then loads it in a fresh subprocess per format with
`ll.load_pretrained(path, quantize=...)` and reports the process's peak resident memory
(VmHWM) above its resident memory before the load (after the imports), the median over
`--repeats` subprocesses, next to the loaded parameters' bytes. The row `int8-after` is
the path before quantize-while-loading (a float load, then `quantization.quantize_model`).
The peak includes the safetensors file's pages mapped while it is read (file-backed,
reclaimable, about the file's size), so the parameters' share is the peak minus that.

Run: PYTHONPATH=$PWD python scripts/bench_quant_loading.py [--layers 16] [--repeats 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
import jax
import logitloop as ll
from flax import nnx
from logitloop.models import quantization

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

fmt = None if sys.argv[2] == "float" else sys.argv[2]
before = status("VmRSS")
if fmt == "int8-after":  # the previous path: a whole float load, then quantized
    model = ll.load_pretrained(sys.argv[1])
    quantization.quantize_model(model, quantization.check_quantize("int8"))
else:
    model = ll.load_pretrained(sys.argv[1], quantize=fmt)
jax.block_until_ready(nnx.state(model))
print(json.dumps({"peak": status("VmHWM") - before, "file": status("RssFile"),
                  "params": quantization.parameter_bytes(model)}))
"""


def write_checkpoint(folder: Path, layers: int, hidden: int, mlp: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, head_dim = hidden // 64, hidden // 128, 64
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": mlp,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(mlp, hidden),
            p + "mlp.up_proj.weight": rand(mlp, hidden),
            p + "mlp.down_proj.weight": rand(hidden, mlp),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, folder / "model.safetensors")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mlp", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args.layers, args.hidden, args.mlp, args.vocab)
        size = (folder / "model.safetensors").stat().st_size
        print(f"checkpoint: {size / 2**30:.3f} GiB bfloat16 safetensors")
        base = None
        for fmt in ("float", "int8", "int4", "int8-after"):
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(folder), fmt],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            peak = statistics.median(r["peak"] for r in runs)
            params = runs[0]["params"]
            base = base or peak
            print(
                f"{fmt:10s}: peak RSS during load {peak / 2**30:.3f} GiB "
                f"({peak / base:.2f}x of float), parameters {params / 2**30:.3f} GiB, "
                f"file-backed RSS after {runs[0]['file'] / 2**30:.3f} GiB"
            )


if __name__ == "__main__":
    main()
