"""`quantize_embedding=True`: the vocabulary tables (embedding, LM head) as Qwix `QArray`s
with a scale per vocabulary row. The lookup and the head's logits against a float64 NumPy
reference of the dequantized table, the whole model against the same model with the
dequantized table in float, tied (one table) and untied (two), quantize-while-loading,
the Orbax round trip, and the bad-input errors."""

import sys
from pathlib import Path

import numpy as np
import pytest

qwix = pytest.importorskip("qwix", reason="quantized weights need the extra `quant` (qwix)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.models import quantization  # noqa: E402
from logitloop.models.fixed_order import PLAIN, Numerics, head_product  # noqa: E402
from tests.models.quantized_reference import dequantized as _dequantized  # noqa: E402


def small_llama(tied: bool = True):
    """A 2-layer random Llama of hidden size 32 and a 96-token vocabulary (float32)."""
    config = ll.models.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    return ll.models.LlamaModel(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 16), ("fp8", None)])
def test_lookup_and_head_match_float64_reference(fmt, group):
    table = jax.random.normal(jax.random.key(0), (40, 64), jnp.float32)
    spec = quantization.check_quantize(fmt, group, quantize_embedding=True)
    q = quantization.quantize_vocab_rows("embedding", table, spec)
    groups = 1 if fmt != "int4" else 64 // group
    assert q.scale.shape == (40, groups)  # a scale per vocabulary row (and int4 group)
    reference = _dequantized(q)
    tokens = jnp.array([[3, 39, 0], [7, 7, 45]])  # 45: past the vocabulary, clipped
    rows = np.asarray(quantization.lookup(q, tokens, jnp.float32), np.float64)
    np.testing.assert_allclose(rows, reference[np.minimum(np.asarray(tokens), 39)], rtol=1e-6)
    x = jax.random.normal(jax.random.key(1), (5, 64), jnp.float32)
    model_parallel = Numerics(deterministic="model-parallel")
    for numerics in (PLAIN, Numerics(deterministic=True), model_parallel):
        logits = head_product(x, q, numerics=numerics)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(
            np.asarray(logits, np.float64),
            np.asarray(x, np.float64) @ reference.T,
            rtol=1e-4,
            atol=1e-4,
        )
    # the model-parallel policy's fixed vocabulary tiles run on the dequantized table
    dequantized = jnp.asarray(reference, jnp.float32)
    assert np.array_equal(
        head_product(x, q, numerics=model_parallel),
        head_product(x, dequantized, numerics=model_parallel),
    )
    error = np.abs(reference - np.asarray(table, np.float64)).max()
    assert error < {"int8": 0.02, "fp8": 0.07, "int4": 0.3}[fmt] * float(jnp.abs(table).max())


def _with_float_tables(model, dequantized: dict):
    """`model` with each quantized vocabulary table replaced by its float value."""
    for path, param in nnx.iter_graph(model):
        if tuple(path) in dequantized:
            param.set_value(jnp.asarray(dequantized[tuple(path)], jnp.float32))
    return model


def _quantized_and_reference(tied: bool):
    """A small Llama with int4 projections and tables, and the same model with each
    quantized table in float32 (exactly the dequantized values): only the tables' path
    differs between the two."""
    spec = quantization.check_quantize("int4", 16, quantize_embedding=True)
    model = small_llama(tied)
    quantization.quantize_model(model, spec)
    tables = {("embedding",)} | (set() if tied else {("lm_head",)})
    reference = _with_float_tables(
        nnx.clone(model), {p: _dequantized(model_param(model, p)) for p in tables}
    )
    return model, reference, tables


@pytest.mark.parametrize(
    "tied", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied"]
)
def test_model_with_quantized_tables_equals_dequantized_float_tables(tied):
    model, reference, tables = _quantized_and_reference(tied)
    spec = model.quantization.spec
    assert {p for p, c in quantization.plan(model, spec)[1].items() if c < 0} == tables
    assert model.quantization.vocab_tables == len(tables)
    assert "LM head int4 per vocabulary row" in model.quantization.describe()
    assert quantization.is_quantized(model.head_weight())
    tokens = jnp.array([[5, 9, 80, 3], [0, 1, 2, 95]], jnp.int32)
    positions = jnp.array([[-1, 0, 1, 2], [0, 1, 2, 3]], jnp.int32)
    forward = nnx.jit(lambda m, t, p: m(t, p, m.init_cache(2, 8))[0])  # compiled: 4x faster
    got, want = forward(model, tokens, positions), forward(reference, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_generate_with_quantized_tables(tied):
    model, reference, _ = _quantized_and_reference(tied)
    prompts = [[5, 9, 80], [1, 2]]
    for deterministic in (False, True):
        out = ll.generate(model, prompts, max_new_tokens=3, temperature=0.0,
                          deterministic=deterministic)  # fmt: skip
        ref = ll.generate(reference, prompts, max_new_tokens=3, temperature=0.0,
                          deterministic=deterministic)  # fmt: skip
        assert out.token_ids == ref.token_ids


def model_param(model, path):
    for p, param in nnx.iter_graph(model):
        if tuple(p) == path:
            return param[...]
    raise KeyError(path)


def _leaves(model):
    return jax.tree.leaves(quantization.to_storable(nnx.to_pure_dict(nnx.state(model, nnx.Param))))


@pytest.mark.slow
def test_untied_checkpoint_quantized_while_loading_and_orbax_round_trip(tmp_path):
    """An untied Llama checkpoint: both tables quantized as they are read equal quantizing
    the float load; the Orbax round trip restores them bit for bit."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_checkpoints import build_hf_model, save_hf_model

    from logitloop.models import orbax_io

    directory = save_hf_model(build_hf_model("llama"), tmp_path / "llama")
    loaded = ll.load_pretrained(directory, quantize="int8", quantize_embedding=True)
    after = ll.load_pretrained(directory)
    quantization.quantize_model(after, quantization.check_quantize("int8", None, True))
    assert loaded.quantization == after.quantization
    assert loaded.quantization.vocab_tables == 2
    for a, b in zip(_leaves(loaded), _leaves(after), strict=True):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))
    orbax_io.save_converted(loaded, tmp_path / "saved")
    restored = orbax_io.restore_converted(tmp_path / "saved")
    assert restored.quantization == loaded.quantization
    assert quantization.is_quantized(restored.lm_head[...])
    for a, b in zip(_leaves(loaded), _leaves(restored), strict=True):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))


def test_version_2_record_reads_as_float_tables():
    record = {"storage_version": 2, "format": "int8", "group_size": 128}
    spec = quantization.spec_from_record(record, "meta.json")
    assert spec == quantization.QuantizeSpec("int8", None, embedding=False)  # 128: unused
    with pytest.raises(
        ValueError, match=r"storage version 1; this logitloop reads versions 2 and 3"
    ):
        quantization.spec_from_record(dict(record, storage_version=1), "meta.json")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="quantize_embedding must be True or False, got 'yes'"):
        ll.load_pretrained(quantize="int8", quantize_embedding="yes")
    with pytest.raises(ValueError, match="quantize_embedding=True needs a format"):
        ll.load_pretrained(quantize_embedding=True)
    spec = quantization.check_quantize("int4", 24, quantize_embedding=True)
    with pytest.raises(
        ValueError,
        match=r"embedding has shape \(40, 64\); its embedding axis 1 \(64\) is not "
        "divisible by group_size=24",
    ):
        quantization.quantize_vocab_rows("embedding", jnp.zeros((40, 64)), spec)


def _all_dequantized(model):
    """`model` with every `QArray` replaced by its float value in the float weight's shape
    (the output projection is stored as `[H * D, E]`)."""
    out = nnx.clone(model)
    for _, param in nnx.iter_graph(out):
        if isinstance(param, nnx.Param) and quantization.is_quantized(param[...]):
            param.set_value(jnp.asarray(_dequantized(param[...]), jnp.float32))
    for block in out.layers:
        c = out.config
        block.wo.set_value(block.wo[...].reshape(c.num_heads, c.head_dim, c.hidden_size))
    return out


@pytest.mark.parametrize(
    "numerics",
    [
        pytest.param(Numerics(deterministic="model-parallel"), marks=pytest.mark.slow),
        pytest.param(Numerics(deterministic=True, tile_kernel="interpret"), marks=pytest.mark.slow),
    ],
    ids=["model-parallel", "tile-kernel"],
)
def test_fixed_order_policies_run_on_the_dequantized_weights(numerics):
    """Under the chunked contraction and the tile kernel a quantized weight is
    dequantized before its product: the logits are the float model's on the dequantized
    weights (float32: the same values) under the same policy, bit for bit op by op.
    (Compiled, XLA:CPU fuses the two programs differently: ~1e-7 apart.)"""
    model, _, _ = _quantized_and_reference(True)
    reference = _all_dequantized(model)
    tokens = jnp.array([[5, 9, 80, 3], [0, 1, 2, 95]], jnp.int32)
    positions = jnp.array([[-1, 0, 1, 2], [0, 1, 2, 3]], jnp.int32)
    got = model(tokens, positions, model.init_cache(2, 8), numerics=numerics)[0]
    want = reference(tokens, positions, reference.init_cache(2, 8), numerics=numerics)[0]
    assert np.array_equal(np.asarray(got), np.asarray(want))
