"""Parameter bytes of a quantized model against bfloat16, measured from the arrays.

A random Llama of Llama 3.2 1B's shapes (hidden 2048, MLP 8192, 16 layers, 32/8 heads of
64, vocabulary 128256, tied embedding) is built abstractly (`loading.abstract_model`) and
filled one tensor at a time with random bfloat16 values, then quantized the way
`load_pretrained(quantize=...)` does (`quantization.quantize_model`), with the tied
embedding / LM head kept in bfloat16 (the default) and quantized (`quantize_embedding=True`,
"+emb"); the bytes are counted from the resulting arrays two ways: as the format counts
them (`quantization.parameter_bytes`, int4 at half a byte) and as the backend holds them
(`quantization.device_bytes`, the arrays' device buffers: XLA:CPU keeps an int4 value in a
whole byte).

Run: PYTHONPATH=$PWD python scripts/bench_quant.py [--layers 16]
"""

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import LlamaConfig, quantization
from logitloop.models.loading import abstract_model


def one_b_model(layers: int):
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = abstract_model(config, jnp.bfloat16)
    key = jax.random.key(0)
    for i, (_, param) in enumerate(nnx.iter_graph(model)):
        if isinstance(param, nnx.Param):
            shape = param.get_value().shape
            value = 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
            param.set_value(value.astype(jnp.bfloat16))
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    float_bytes = None
    for fmt, embedding in (
        (None, False),
        ("int8", False),
        ("int4", False),
        ("int8", True),
        ("int4", True),
    ):
        model = one_b_model(args.layers)
        if fmt is not None:
            start = time.perf_counter()
            spec = quantization.check_quantize(fmt, quantize_embedding=embedding)
            quantization.quantize_model(model, spec)
            took = time.perf_counter() - start
        n = quantization.parameter_bytes(model)
        held = quantization.device_bytes(model)
        if fmt is None:
            float_bytes = n
            print(f"bfloat16: {n / 2**30:.3f} GiB (device buffers {held / 2**30:.3f} GiB)")
        else:
            name = fmt + ("+emb" if embedding else "")
            print(
                f"{name}: {n / 2**30:.3f} GiB = {n / float_bytes:.3f}x of bfloat16 as the "
                f"format counts; device buffers ({jax.default_backend()}) "
                f"{held / 2**30:.3f} GiB = {held / float_bytes:.3f}x (quantized in {took:.1f} s)"
            )
        del model


if __name__ == "__main__":
    main()
