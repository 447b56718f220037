"""A quantized model's decode loop holds no float copy of its weights: XLA's temporaries of
the compiled decode `while_loop` (`memory_analysis()`), of `generate` and of
`generate_many`, against the float model's.

Qwix's product dequantizes a weight (values times scales) before a float product. That
value depends on the weight alone, so XLA hoisted it out of the decode loop: the loop then
held a float copy of every quantized weight, and an int8 Llama 3.2 1B shape peaked above
the float model during `generate` (`quantization.at_use` keeps it in the step; RSS numbers
in BENCHMARKS.md, `scripts/bench_quant_memory.py`)."""

import math

import pytest

qwix = pytest.importorskip("qwix", reason="quantized weights need the extra `quant` (qwix)")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.decoding.engine import batcher, generate  # noqa: E402
from logitloop.decoding.loop import decode_loop  # noqa: E402
from logitloop.models import quantization  # noqa: E402


def _model(fmt):
    """A 4-layer random Llama, hidden 256 and MLP 1024 (its projections 16 MB in float32,
    far more than the rest of the decode loop's temporaries), float32, `fmt` weights."""
    config = ll.models.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    model = ll.models.LlamaModel(config, rngs=nnx.Rngs(0))
    if fmt is not None:
        quantization.quantize_model(
            model, quantization.check_quantize(fmt, 64 if fmt == "int4" else None)
        )
    return model


class _Captured(Exception):
    pass


def _generate(model):
    ll.generate(model, [[5, 6, 7]], max_new_tokens=4, temperature=0.0)


def _generate_many(model):
    ll.generate_many(model, [[5, 6, 7], [8, 9]], slots=2, max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def decode_temporaries():
    """`(fmt, run) -> bytes`: XLA's temporaries of the decode loop that `run(model)` calls
    first on `_model(fmt)`, compiled from its arguments' shapes (the loop itself is not
    run); each pair measured once per module."""
    done = {}

    def measure(fmt, run):
        if (fmt, run) in done:
            return done[fmt, run]
        seen = {}

        def spy(program, tables, state, max_steps):
            shapes = (tables, state, max_steps)
            seen["args"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
            seen["program"] = program
            raise _Captured

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generate, "decode", spy)
            patch.setattr(batcher, "decode", spy)
            with pytest.raises(_Captured):
                run(_model(fmt))
        compiled = decode_loop.decode.trace(seen["program"], *seen["args"]).lower().compile()
        done[fmt, run] = int(compiled.memory_analysis().temp_size_in_bytes)
        return done[fmt, run]

    return measure


def _quantized_values(fmt) -> list:
    tree = nnx.state(_model(fmt), nnx.Param)
    leaves = jax.tree.leaves(tree, is_leaf=quantization.is_quantized)
    return [leaf.qvalue for leaf in leaves if quantization.is_quantized(leaf)]


# generate_many's loop is the same `decode_loop.decode` on another state (-m slow: two more
# compiles of the loop); the default case pins the property on `generate`'s.
@pytest.mark.parametrize(
    "run",
    [_generate, pytest.param(_generate_many, marks=pytest.mark.slow)],
    ids=["generate", "generate_many"],
)
def test_int8_decode_loop_holds_no_float_copy_of_the_weights(decode_temporaries, run):
    float_temp = decode_temporaries(None, run)
    int8_temp = decode_temporaries("int8", run)
    values = _quantized_values("int8")
    copies = sum(4 * math.prod(q.shape) for q in values)  # all of them in float32: 16 MB
    largest = max(4 * math.prod(q.shape) for q in values)  # one MLP weight: 1 MB
    # Hoisted, the loop held every dequantized weight (float + 16 MB); in the step, one
    # product's weight at a time (the gate and up projections may be live together).
    assert int8_temp - float_temp <= 2 * largest, (float_temp, int8_temp, copies)


@pytest.mark.slow
def test_int4_decode_loop_holds_at_most_a_byte_per_value(decode_temporaries):
    """XLA:CPU widens an int4 weight to int8 before any other operation on it, and that
    widening is hoisted out of the loop (a byte per value, a quarter of a float copy): what
    is left here, and bounded, until a backend takes int4 operands as they are."""
    float_temp = decode_temporaries(None, _generate)
    int4_temp = decode_temporaries("int4", _generate)
    values = _quantized_values("int4")
    count = sum(math.prod(q.shape) for q in values)
    largest = max(4 * math.prod(q.shape) for q in values)
    assert int4_temp - float_temp <= count + 2 * largest, (float_temp, int4_temp, count)
