"""The Pallas sampling kernel against the XLA path, and lowering for CUDA and TPU from here.

`TestSamplingKernel` runs the kernel compiled (GPU only); `TestSamplingKernelInterpret` runs
the same tests in Pallas interpret mode on any platform. Every test draws fresh logits
(with exact ties, -inf entries or large magnitudes) and per-row settings, runs both paths
and requires the same kept set under each filter, the same token, and log-probabilities
within 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.decoding.sampling.history import History
from logitloop.models import LlamaConfig, LlamaModel
from logitloop.ops.sampling import dispatch, pallas, xla

NEG_INF = float("-inf")
# Shapes are few because each compiles once per path; V is rarely a multiple of the block.
SHAPES = ((2, 3001), (5, 3001), (8, 1000))
KINDS = ("normal", "ties", "masked", "large")
SETTINGS = (
    "greedy",
    "temperature_only",
    "top_k_small",
    "top_k_large",
    "top_p_small",
    "top_p_wide",
    "min_p",
    "combined",
    "mixed",
)


def _logits(rng: np.random.Generator, batch: int, vocab: int, kind: str) -> np.ndarray:
    """[B, V] f32 scaled logits of one kind; every row keeps at least one finite entry."""
    x = rng.normal(size=(batch, vocab)) * rng.uniform(0.3, 4.0, size=(batch, 1))
    if kind == "ties":
        # A few dozen distinct values, each shared by many tokens; none at 0, whose ties have
        # their own tests (test_many_ties_at_zero*).
        x = np.round(x * 2) / 2 + 0.25
    elif kind == "masked":
        x[rng.random(size=x.shape) < rng.uniform(0.3, 0.99, size=(batch, 1))] = NEG_INF
        x[np.arange(batch), rng.integers(0, vocab, batch)] = rng.normal(size=batch)
        x[-1, :] = NEG_INF  # one row with a single finite token
        x[-1, rng.integers(0, vocab)] = 1.0
    elif kind == "large":
        x = x * rng.choice([30.0, 1e3], size=(batch, 1)) + rng.choice([-3e4, 0.0, 3e4], (batch, 1))
        x[:, rng.integers(0, vocab, 3)] = x.max(axis=1, keepdims=True)  # tied maxima
    return x.astype(np.float32)


def _settings(rng: np.random.Generator, batch: int, vocab: int, name: str) -> dict:
    """Per-row [B] top_k, top_p, min_p, greedy for one named sampler setting."""
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    min_p = np.zeros(batch, np.float32)
    greedy = np.zeros(batch, bool)
    if name == "greedy":
        greedy[:] = True
        top_k[:] = rng.choice([0, 1], batch)
    elif name == "top_k_small":
        top_k[:] = rng.integers(2, 21, batch)
    elif name == "top_k_large":  # up to and beyond the XLA path's candidates
        low = min(65, max(vocab - 1, 1))
        top_k[:] = rng.integers(low, max(vocab, low + 1), batch)
    elif name == "top_p_small":
        top_p[:] = rng.uniform(0.05, 0.5, batch)
    elif name == "top_p_wide":  # nucleus of hundreds of tokens for the normal logits
        top_p[:] = rng.uniform(0.95, 0.9999, batch)
    elif name == "min_p":
        min_p[:] = rng.uniform(0.001, 0.3, batch)
    elif name == "combined":
        top_k[:] = rng.integers(10, 400, batch)
        top_p[:] = rng.uniform(0.5, 0.995, batch)
        min_p[:] = rng.uniform(0.0005, 0.1, batch)
    elif name == "mixed":  # each row its own setting, including ones that switch filters off
        for r in range(batch):
            one = _settings(rng, 1, vocab, rng.choice(SETTINGS[:-1]))
            top_k[r], top_p[r], min_p[r], greedy[r] = (one[f][0] for f in one)
            if rng.random() < 0.3:
                top_k[r] = rng.choice([-1, vocab, vocab + 7])
    return dict(top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy)


def _inputs(case: str, batch: int, vocab: int, kind: str, setting: str):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    x = _logits(rng, batch, vocab, kind)
    s = _settings(rng, batch, vocab, setting)
    key = rng.integers(0, 2**32, size=(batch, 2), dtype=np.uint32)
    args = (x, s["top_k"], s["top_p"], s["min_p"], s["greedy"], key)
    return tuple(jnp.asarray(a) for a in args)


_xla_path = jax.jit(xla.filter_and_sample)  # compiled once per shape, not op by op


def _assert_matches_xla(args, draw: xla.Draw, thr: xla.Thresholds):
    """The kernel's draw and thresholds against the XLA path's on the same inputs."""
    want_draw, want_thr = _xla_path(*args)
    draw, thr, want_draw, want_thr = jax.tree.map(np.asarray, (draw, thr, want_draw, want_thr))
    x, greedy = np.asarray(args[0]), np.asarray(args[4])
    sampled = ~greedy
    np.testing.assert_array_equal(draw.tokens, want_draw.tokens)
    np.testing.assert_array_equal(thr.row_max, want_thr.row_max)
    for name in ("top_k", "top_p", "min_p"):  # the kept set under each filter alone
        got = x >= getattr(thr, name)[:, None]
        want = x >= getattr(want_thr, name)[:, None]
        np.testing.assert_array_equal(got[sampled], want[sampled], err_msg=name)
    # Greedy rows keep the tied maxima and draw the lowest of them with probability one.
    np.testing.assert_array_equal(thr.kept[greedy], thr.row_max[greedy])
    np.testing.assert_array_equal(draw.logprobs[greedy], 0.0)
    np.testing.assert_allclose(draw.logprobs, want_draw.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        draw.log_norm[sampled], want_draw.log_norm[sampled], rtol=1e-6, atol=1e-5
    )
    kept = x >= thr.kept[:, None]
    assert kept[np.arange(len(x)), draw.tokens].all()


class TestSamplingKernel:
    """The kernel compiled for the accelerator; skipped where there is no GPU."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip(
                "the compiled Pallas kernel needs a GPU: run on a GPU machine as "
                "docs/device_check.md says (here, the Interpret subclass runs the same tests)"
            )

    def run(self, *args, **kwargs):
        return pallas.filter_and_sample_pallas(*args, interpret=self.INTERPRET, **kwargs)

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("setting", SETTINGS)
    def test_matches_xla_path(self, setting, kind):
        case = f"{setting}-{kind}"
        batch, vocab = SHAPES[zlib.crc32(case.encode()) % len(SHAPES)]
        args = _inputs(case, batch, vocab, kind, setting)
        _assert_matches_xla(args, *self.run(*args))

    @pytest.mark.parametrize(("block", "num_pivots"), [(128, 1), (256, 4), (512, 32)])
    def test_block_and_pivots_do_not_change_the_draw(self, block, num_pivots):
        args = _inputs(f"knobs-{block}", 8, 4096, "ties", "mixed")
        _assert_matches_xla(args, *self.run(*args, block=block, num_pivots=num_pivots))

    @pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (4, 37)])
    def test_vocab_smaller_than_a_block(self, batch, vocab):
        args = _inputs(f"tiny-{vocab}", batch, vocab, "ties", "mixed")
        _assert_matches_xla(args, *self.run(*args))

    def test_row_does_not_depend_on_the_batch(self):
        args = _inputs("batch", 5, 3001, "normal", "mixed")
        whole, _ = self.run(*args)
        pair, _ = self.run(*(a[np.array([3, 0])] for a in args))  # other rows, other order
        np.testing.assert_array_equal(pair.tokens, np.asarray(whole.tokens)[[3, 0]])

    def test_large_vocabulary(self):
        if self.INTERPRET:
            pytest.skip("a 128256-token vocabulary is too slow in interpret mode")
        args = _inputs("llama3", 64, 128256, "normal", "mixed")
        _assert_matches_xla(args, *self.run(*args))

    def test_many_ties_at_zero(self):
        args, want_kept = _ties_at_zero()
        _, thr = self.run(*args)
        np.testing.assert_array_equal(
            np.asarray(args[0]) >= np.asarray(thr.kept)[:, None], want_kept
        )


class TestSamplingKernelInterpret(TestSamplingKernel):
    INTERPRET = True


def _ties_at_zero():
    """Rows whose k-th largest value is 0.0, tied (as +0.0 and -0.0) by ~1000 tokens."""
    rng = np.random.default_rng(0)
    x = rng.choice(np.float32([1.0, 0.0, -0.0, -1.0]), size=(2, 3001), p=[0.1, 0.17, 0.17, 0.56])
    k = np.int32([400, 1000])
    args = (x, k, np.float32([1.0, 0.999]), np.zeros(2, np.float32), np.zeros(2, bool))
    args += (rng.integers(0, 2**32, size=(2, 2), dtype=np.uint32),)
    kth = -np.sort(-x, axis=1)[np.arange(2), k - 1]
    assert (kth == 0).all()
    return tuple(jnp.asarray(a) for a in args), x >= kth[:, None]


def test_many_ties_at_zero_xla_path():
    """More than C tokens tied at exactly 0.0: the interval search must end on 0.0 itself."""
    args, want_kept = _ties_at_zero()
    _, thr = _xla_path(*args)
    np.testing.assert_array_equal(np.asarray(args[0]) >= np.asarray(thr.kept)[:, None], want_kept)


def test_bad_static_knobs_are_rejected():
    args = _inputs("knobs", 1, 64, "normal", "temperature_only")
    for bad in (dict(block=96), dict(num_pivots=3), dict(num_pivots=0)):
        with pytest.raises(ValueError, match="power of two"):
            pallas.filter_and_sample_pallas(*args, interpret=True, **bad)


def test_auto_picks_the_kernel_on_gpu_only(monkeypatch):
    assert dispatch.resolve_backend("auto") == (
        "pallas" if jax.default_backend() == "gpu" else "xla"
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve_backend("auto") == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert dispatch.resolve_backend("auto") == "xla"
    with pytest.raises(ValueError, match="backend"):
        dispatch.resolve_backend("triton")


def test_dispatch_interpret_runs_the_kernel():
    args = _inputs("dispatch", 8, 1000, "normal", "combined")
    got, _ = dispatch.filter_and_sample(*args, backend="pallas", interpret=True)
    want, _ = _xla_path(*args)
    np.testing.assert_array_equal(got.tokens, want.tokens)


# ----------------------------------------------------------------------------- lowering


def _shapes(batch: int, vocab: int):
    s = jax.ShapeDtypeStruct
    return (
        s((batch, vocab), jnp.float32),
        s((batch,), jnp.int32),
        s((batch,), jnp.float32),
        s((batch,), jnp.float32),
        s((batch,), jnp.bool_),
        s((batch, 2), jnp.uint32),
    )


@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (3, 37), (8, 3001), (256, 128256)])
def test_kernel_lowers_for_cuda(batch, vocab):
    """Every block size the dispatcher can pick (it follows V) lowers to a Triton call."""
    f = lambda *a: dispatch.filter_and_sample(*a, backend="pallas")
    text = jax.jit(f).trace(*_shapes(batch, vocab)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


# An H100 (sm_90, as the H200) for XLA's compile-only CUDA client.
H100 = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
}
platform_name: "CUDA"
runtime_version { major: 12 minor: 8 }
"""
# Run with JAX_PLATFORMS=cpu in a fresh process: once a process has tried and failed to
# start the CUDA backend, the plugin cannot make a compile-only client any more.
COMPILE_FOR_H100 = """
import sys
import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from logitloop.ops.sampling import pallas

topology = topologies.get_topology_desc(
    platform="cuda", target_config=sys.stdin.read(), topology="1x1x1"
)
mesh = topologies.make_mesh(topo=topology, mesh_shape=(1,), axis_names=("x",))
on_h100 = NamedSharding(mesh, PartitionSpec())
for batch, vocab in [(1, 1), (3, 37), (8, 3001), (256, 128256)]:
    s = jax.ShapeDtypeStruct
    shapes = [s((batch, vocab), "float32")] + [s((batch,), d) for d in ("int32", "float32")]
    shapes += [s((batch,), "float32"), s((batch,), "bool"), s((batch, 2), "uint32")]
    shapes = [s(a.shape, a.dtype, sharding=on_h100) for a in shapes]
    compiled = jax.jit(pallas.filter_and_sample_pallas).trace(*shapes).lower().compile()
    print(batch, vocab, "triton" in compiled.as_text())
"""


def test_kernel_compiles_for_h100_without_a_gpu():
    """XLA's Triton pipeline turns the kernel into sm_90 code for every block size."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip(
            "compiling for CUDA needs jax-cuda12-plugin and ptxas: run on a GPU machine as "
            "docs/device_check.md says"
        )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100],
        input=H100,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == "1 1 True 3 37 True 8 3001 True 256 128256 True".split()


def _sample_inputs(batch: int, vocab: int):
    params = ll.SamplingParams.create(
        batch_size=batch, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05
    ).device_only()
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.bfloat16)
    return logits, params, jax.ShapeDtypeStruct((batch,), jnp.int32)


@pytest.mark.parametrize(("backend", "platform"), [("pallas", "cuda"), ("xla", "tpu")])
def test_sample_lowers(backend, platform):
    logits, params, positions = _sample_inputs(4, 3001)
    traced = ll.sample.trace(logits, params, positions, backend=backend)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" in text) == (backend == "pallas")


def test_decode_loop_lowers_for_tpu():
    """Prefill and the decode loop of a tiny Llama, sampling with every filter on."""
    from logitloop.decoding.loop import decode_loop as loop
    from logitloop.decoding.loop.runner import model_info

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    info = model_info(LlamaModel(config, rngs=nnx.Rngs(0)))
    program = loop.Program(info.runner)
    batch, plen, buf = 2, 16, 16
    params = ll.SamplingParams.create(
        batch_size=batch, temperature=0.8, top_k=[5, 80], top_p=0.9, min_p=0.02
    ).device_only()
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    history = History(i32(batch, plen + buf), i32(batch), i32(batch))
    tables = loop.Tables(info.weights, params)
    prompts = loop.PromptBatch(i32(batch, plen), i32(batch, plen), i32(batch), history)
    static = dict(buffer_len=buf, num_top=0)
    loop.prefill.trace(program, tables, prompts, **static).lower(lowering_platforms=("tpu",))
    state = jax.eval_shape(lambda *a: loop.prefill(program, *a, **static), tables, prompts)
    decode = loop.decode.trace(program, tables, state, i32())
    decode.lower(lowering_platforms=("tpu",))
