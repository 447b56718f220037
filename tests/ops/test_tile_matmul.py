"""The Pallas tile kernel of `deterministic=True` on a GPU (`logitloop.ops.tile_matmul`).

On this CPU the kernel runs in interpret mode: its products against a float64 NumPy
reference, a row's bits alone against the same row at random places among random other
rows (the property the kernel exists for), and lowering for CUDA, for the kernel and for a
whole deterministic forward pass, whose every product must then be the kernel. The
compiled kernel runs on a GPU machine (docs/device_check.md).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.decoding.loop.runner import model_info
from logitloop.models import fixed_order
from logitloop.ops.tile_matmul import BLOCK_K, BLOCK_M, BLOCK_N, tile_matmul
from tests.decoding.random_llama import small_llama

# (M, K, N): one row, blocks that fit exactly, and every dimension off its block.
SHAPES = [(1, 64, 128), (BLOCK_M, BLOCK_K * 3, BLOCK_N * 2), (19, 100, 130)]


def _operands(rng, m, k, n, dtype, transposed):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
    return x, w


def _check_products(m, k, n, dtype, transposed, interpret):
    rng = np.random.default_rng(zlib.crc32(repr((m, k, n, dtype, transposed)).encode()))
    x, w = _operands(rng, m, k, n, dtype, transposed)
    out = tile_matmul(x, w, w_transposed=transposed, out_dtype=jnp.float32, interpret=interpret)
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    ref = x64 @ (w64.T if transposed else w64)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    scale = np.abs(x64) @ np.abs(w64.T if transposed else w64)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - ref), 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_products_match_float64(m, k, n, dtype, transposed):
    """Float32 accumulation of the operands as given (bfloat16 operands are exact in
    float64): within 1e-6 of the float64 product per unit of its scale."""
    _check_products(m, k, n, dtype, transposed, interpret=True)


def test_output_dtype_defaults_to_the_operands():
    rng = np.random.default_rng(1)
    x, w = _operands(rng, 3, 40, 70, "bfloat16", False)
    out = tile_matmul(x, w, interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(out, np.float32),
        np.asarray(
            tile_matmul(x, w, out_dtype=jnp.float32, interpret=True).astype(jnp.bfloat16),
            np.float32,
        ),
    )


def _check_rows(transposed, dtype, interpret):
    rng = np.random.default_rng(7)
    k, n = 96, 200
    x, w = _operands(rng, 1, k, n, dtype, transposed)
    run = lambda rows: np.asarray(
        tile_matmul(rows, w, w_transposed=transposed, out_dtype=jnp.float32, interpret=interpret)
    )
    alone = run(x)[0]
    for batch in (2, 3, 17, 64):
        others = jnp.asarray(rng.standard_normal((batch - 1, k)) * 3, dtype)
        at = int(rng.integers(0, batch))
        rows = jnp.concatenate([others[:at], x, others[at:]])
        np.testing.assert_array_equal(run(rows)[at], alone, err_msg=f"batch {batch}, row {at}")


@pytest.mark.parametrize(("transposed", "dtype"), [(False, "float32"), (True, "bfloat16")])
def test_a_row_alone_equals_the_row_among_others(transposed, dtype):
    """Bit for bit: one row's product alone, and at a random place among 1, 2, 16 and 63
    random other rows (other row counts, other row blocks, other places in a block)."""
    _check_rows(transposed, dtype, interpret=True)


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="the compiled kernel needs a GPU: run on a GPU machine (docs/device_check.md)",
)
class TestCompiledOnGPU:
    """The same checks with the kernel compiled, and generation with `deterministic=True`,
    which takes the kernel on a GPU by itself."""

    @pytest.mark.parametrize("transposed", [False, True])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize(("m", "k", "n"), SHAPES)
    def test_products_match_float64(self, m, k, n, dtype, transposed):
        _check_products(m, k, n, dtype, transposed, interpret=False)

    @pytest.mark.parametrize(("transposed", "dtype"), [(False, "float32"), (True, "bfloat16")])
    def test_a_row_alone_equals_the_row_among_others(self, transposed, dtype):
        _check_rows(transposed, dtype, interpret=False)

    @pytest.mark.parametrize("batch", [2, 5, 17, 64])
    def test_generation_row_alone_equals_row_in_batch(self, batch):
        from tests.decoding.test_deterministic import _alone, _in_batch, _target

        model = small_llama(512, 512, 5)
        assert model_info(model, deterministic=True).runner.numerics.tile_kernel == "pallas"
        prompt = _target(512, 3)
        assert _in_batch(model, prompt, batch, batch) == _alone(model, prompt)


def test_bad_operands_name_the_shapes():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="x has 8 columns but w rows 9"):
        tile_matmul(x, jnp.zeros((9, 4)), interpret=True)
    with pytest.raises(ValueError, match="share a dtype"):
        tile_matmul(x, jnp.zeros((8, 4), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="2-d"):
        tile_matmul(jnp.zeros((2, 2, 8)), jnp.zeros((8, 4)), interpret=True)


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "transposed"),
    [
        (1, 512, 32000, "bfloat16", True),
        (8, 704, 256, "float32", False),
        (64, 256, 4096, "bfloat16", True),
    ],
)
def test_the_kernel_lowers_for_cuda(m, k, n, dtype, transposed):
    """llama-40m's head at batch 1, the shipped model's down projection at 8 rows and its
    head over a 64-row prompt tile: each a Triton call."""
    s = jax.ShapeDtypeStruct
    f = lambda x, w: tile_matmul(x, w, w_transposed=transposed, out_dtype=jnp.float32)
    w_shape = (n, k) if transposed else (k, n)
    text = (
        jax.jit(f)
        .trace(s((m, k), dtype), s(w_shape, dtype))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kernel", ["pallas", None])
def test_every_product_of_a_deterministic_gpu_forward_is_the_kernel(kernel):
    """A decode step of a deterministic Llama lowered for CUDA with the tile kernel holds
    no XLA dot (attention's sums are elementwise, `fixed_order.attention`): every product,
    the LM head's too, is a Triton call. Without the kernel it holds XLA's dots."""
    model = small_llama(512, 64, 5)
    numerics = fixed_order.calibrate(True, tile_kernel=kernel, backend="gpu")
    info = model_info(model, deterministic=numerics)
    runner = info.runner
    cache = runner.init_cache(info.weights, 3, 64)
    tokens, positions = jnp.zeros((3, 1), jnp.int32), jnp.full((3, 1), 5, jnp.int32)
    step = jax.jit(lambda w, t, p, c: runner.forward(w, t, p, c))
    text = (
        step.trace(info.weights, tokens, positions, cache)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    has_dots = "stablehlo.dot_general" in text or "stablehlo.dot " in text
    if kernel:
        assert "__gpu$xla.gpu.triton" in text and not has_dots
    else:
        assert "__gpu$xla.gpu.triton" not in text and has_dots


def test_which_runners_take_the_kernel():
    """`deterministic=True` on a GPU takes it; the default mode, the model-parallel mode
    and other backends do not; `calibrate(tile_kernel=...)` chooses it, checked."""

    def kernel(deterministic, backend="cpu", **kw):
        return fixed_order.calibrate(deterministic, backend=backend, **kw).tile_kernel

    assert kernel(True, "gpu") == "pallas"
    assert kernel(True, "cpu") is None
    assert kernel(False, "gpu") is None
    assert kernel("model-parallel", "gpu") is None
    assert kernel(True, tile_kernel="interpret") == "interpret"
    assert kernel(False, tile_kernel="interpret") is None
    interpret = fixed_order.calibrate(True, tile_kernel="interpret")
    info = model_info(small_llama(64, 32, 0), deterministic=interpret)
    assert info.runner.numerics.tile_kernel == "interpret"
    assert kernel(True, "gpu", tile_kernel="off") is None
    with pytest.raises(ValueError, match="tile_kernel must be 'auto', 'off', None or one of"):
        kernel(True, tile_kernel="triton")
    with pytest.raises(ValueError, match="does not split a model axis"):
        fixed_order.Numerics(deterministic="model-parallel", tile_kernel="pallas")
