"""What the device check's sections share (`scripts/device_check.py`): the shapes of a full
run and of the smoke, the devices' HBM bandwidth for the floors, a section's table row,
and `Check` (the clock, the floors' bandwidth, the random models, built once)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logitloop.models import LlamaModel, fixed_order

# Peak HBM bandwidth in bytes/s by a substring of `device_kind` (first match wins).
HBM_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("TPU v5 lite", 0.82e12),  # v5e
    ("TPU v5e", 0.82e12),
    ("TPU v5p", 2.76e12),
    ("TPU v5", 2.76e12),  # v5p reports "TPU v5"
    ("TPU v6 lite", 1.64e12),  # v6e
    ("TPU v6e", 1.64e12),
)


def hbm_bandwidth(device_kind: str) -> float | None:
    """Bytes/s of a device kind's HBM (`HBM_BANDWIDTH`), or None for a kind not there."""
    known = [bw for name, bw in HBM_BANDWIDTH if name.lower() in device_kind.lower()]
    return known[0] if known else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    """Every size the sections use: `FULL` on an accelerator, `SMOKE` on a CPU."""

    vocab: int  # sampling section
    sampling_batches: tuple[int, ...]
    repeats: int  # timed calls per measurement (median)
    copy_mib: int  # the copy that measures bandwidth where the table has no entry
    model: str  # bench_generate.MODELS
    decode_batches: tuple[int, ...]
    prompt: int  # decode prompt tokens (a power of two: its own bucket)
    new_tokens: int  # decode run; the short run takes new_tokens // 2 + 1 (same bucket)
    prefill: int  # prompt tokens of the prefill section
    deterministic_batches: tuple[int, ...]
    shipped_tokens: int  # copy-heavy task's tokens on the shipped model
    paged: dict  # the paged kernel's shape


FULL = Shapes(
    vocab=128256,
    sampling_batches=(1, 64, 256),
    repeats=20,
    copy_mib=1024,
    model="llama-1b",
    decode_batches=(1, 8, 64),
    prompt=64,
    new_tokens=256,
    prefill=32768,
    deterministic_batches=(1, 8),
    shipped_tokens=96,
    paged=dict(batch=64, heads=32, kv_heads=8, head_dim=64, page_size=16, pages_per_row=128),
)
SMOKE = Shapes(
    vocab=1000,
    sampling_batches=(3,),
    repeats=1,
    copy_mib=16,
    model="tiny",
    decode_batches=(1,),
    prompt=64,
    new_tokens=16,
    prefill=256,
    deterministic_batches=(2,),  # the row-alone check below runs batch 1 too
    shipped_tokens=8,
    paged=dict(batch=2, heads=4, kv_heads=2, head_dim=16, page_size=4, pages_per_row=4),
)


# Where full runs keep their compiled programs (JAX's persistent cache), unless
# JAX_COMPILATION_CACHE_DIR names another folder.
COMPILE_CACHE = Path.home() / ".cache" / "logitloop" / "device_check"
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


class OutOfTime(Exception):
    """A section's budget ran out."""


@dataclasses.dataclass
class Row:
    """One section's line of the table: what ran, what it measured, and whether it held."""

    number: int
    section: str
    setup: str = ""
    parts: list[str] = dataclasses.field(default_factory=list)
    status: str = "ok"  # ok | FAILED | error | out of time | not landed | n/a
    seconds: float = 0.0

    def add(self, text: str) -> None:
        self.parts.append(text)

    def fail(self, text: str) -> None:
        self.status = "FAILED"
        self.add(text)

    def markdown(self) -> str:
        cells = [
            f"{self.number} {self.section}",
            self.setup,
            "; ".join(self.parts),
            self.status,
            f"{self.seconds:.1f}",
        ]
        return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


TABLE_HEAD = "| section | setup | result | status | s |\n|---|---|---|---|---|"


class Check:
    """What the sections share: shapes, the clock, the floors' bandwidth, the models."""

    def __init__(self, shapes: Shapes, smoke: bool):
        self.shapes = shapes
        self.smoke = smoke
        self.backend = jax.default_backend()
        self.device = jax.devices()[0]
        # Pallas kernels run compiled on a GPU and in interpret mode anywhere else.
        self.interpret = self.backend != "gpu"
        # `deterministic=`: the smoke runs the GPU's tile kernel interpreted off a GPU.
        interpreted = smoke and self.interpret
        self.deterministic = (
            fixed_order.calibrate(True, tile_kernel="interpret") if interpreted else True
        )
        self.deadline = float("inf")
        self.bandwidth, self.bandwidth_source = None, None
        self._models = {}

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise OutOfTime

    def memory(self) -> dict:
        return self.device.memory_stats() or {}

    def floor_bandwidth(self) -> tuple[float, str]:
        """Bytes/s for the floors: the device's HBM bandwidth from the table, else a
        device-to-device copy measured here."""
        if self.bandwidth is None:
            kind = self.device.device_kind
            known = hbm_bandwidth(kind)
            if known and self.backend != "cpu":
                self.bandwidth, self.bandwidth_source = known, f"{kind} HBM"
            else:
                import bench_gpu_sampler  # noqa: PLC0415 - a sibling script

                mib = self.shapes.copy_mib
                self.bandwidth = bench_gpu_sampler.copy_bandwidth(mib, 5)
                self.bandwidth_source = f"{mib} MiB copy measured"
        return self.bandwidth, self.bandwidth_source

    def model(self, name: str | None = None, context: int = 1024):
        """A random bfloat16 Llama of `bench_generate.MODELS` (seed 0), built once."""
        name = name or self.shapes.model
        if name not in self._models:
            from bench_generate import config  # noqa: PLC0415 - a sibling script

            c = config(name, context=max(context, self.shapes.prefill + 256))
            graphdef, weights = nnx.split(LlamaModel(c, dtype=jnp.bfloat16, rngs=None))
            leaves, tree = jax.tree.flatten(weights)
            self._models[name] = nnx.merge(graphdef, jax.tree.unflatten(tree, _draw(leaves)))
        return self._models[name]


@jax.jit
def _draw(leaves: list[jax.Array]) -> list[jax.Array]:
    """Every matrix N(0, 0.02) (the models' own init) from one draw, vectors (the norms'
    scales) as built: one small program, where the models' own random init compiles a
    random normal per weight (seconds on a CPU, for the tiny model too)."""
    mats = [i for i, x in enumerate(leaves) if x.ndim >= 2]
    sizes = [leaves[i].size for i in mats]
    noise = 0.02 * jax.random.normal(jax.random.key(0), (sum(sizes),), jnp.float32)
    out = list(leaves)
    for i, piece in zip(mats, jnp.split(noise, np.cumsum(sizes)[:-1]), strict=True):
        out[i] = piece.reshape(leaves[i].shape).astype(leaves[i].dtype)
    return out


def gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the smoke's sizes)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
