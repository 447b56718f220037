"""The numerics policy a pass runs under (`Numerics`), the row tiles of its products and
the XLA options of its programs; what a deterministic policy computes, and why, is
`logitloop.models.fixed_order`'s docstring.

The policy is a value, never module state: `fixed_order.calibrate(deterministic,
dtype=...)` builds it (and runs the probes that decide how a decode pass may tile its rows
on this CPU: once per machine, their results kept on disk, `fixed_order.measure`),
`decoding.loop.runner.ModelRunner` carries it as a static field (so it is part of every
program's jit key), and `ModelRunner.forward` passes it, set for the pass
(`Numerics.for_pass`: prompt or decode, the rows' mesh), to the model, which hands it to
every layer function (`logitloop.models.layers`, `ll.dense`). `PLAIN`, the default
everywhere, is every primitive as the plain XLA op.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

# Rows per product tile, by the pass. Plain products are not row-invariant even with
# XLA:CPU's library fusions off (a row alone and in a batch of 8 differ by ~4e-6 in float32
# logits), and a GPU library picks its kernel (and its split of the contraction) by the row
# count. A prompt pass (`loop.forward_prompt`, chunked or not) runs its hidden-state
# products over tiles of PROMPT_TILE rows (a batch's prompts are many rows: few, big
# tiles); a decode step and a speculative verification (generated tokens), and every LM
# head (one row per sequence), over tiles of DECODE_TILE rows. A token position is always
# computed by the same pass whatever the batch (prompt tokens by the prompt pass,
# generated ones by decode or verification), so each product it goes through always has
# the same shape.
PROMPT_TILE = 64
DECODE_TILE = 8
# ... except that on XLA:CPU with YNNPACK's dots (the mode without model-parallel splits,
# whose products are single dots) a decode-pass product takes its rows as they come, up to
# DECODE_TILE (one row padded to 2): a row of `[M, K] x [K, N]` there has the same bits
# for every M from 2 to 32 and any place among the M rows (measured for the model's
# shapes, `tests/decoding/test_deterministic.py`, the tile-product test); only M = 1 (the
# matrix-vector path) and M >= 33 round otherwise. So batch 1 computes two rows, not eight,
# and batch 2-8 no padding at all. (XLA:CPU's own product, the model-parallel mode's, has
# no such range: on an AMD EPYC rows 6 and 7 of 8 round otherwise than rows 0-5.) That
# range is the CPU's, not a promise: on an Intel Xeon the LM head's product of bfloat16
# rows into float32 gives a row other bits for every M from 3 to 16 than for M = 2. So a
# probe decides, once per machine, dtype and kind of product (`unpadded_rows_keep_bits`,
# run by `calibrate`), and a probe of each product shape a decode pass traces
# (`shape_keeps_row_bits`: N <= 8 and N = 4097..4101 failed on the Xeons this ran on), the
# model's own shapes measured by `calibrate` ahead of the trace, all in one program, the
# results kept on disk (`measure`, `probe_record`).

# The Pallas tile kernel's modes (`Numerics.tile_kernel`): compiled (a GPU) and interpreted
# (anywhere: how the CPU tests run the GPU's path).
TILE_KERNELS = ("pallas", "interpret")

# `deterministic=` values: off, invariant to the batch and a data axis, and also to a model
# axis (its products' contraction in fixed chunks, the LM head in fixed vocabulary tiles).
MODEL_PARALLEL = "model-parallel"

# Model-axis sizes whose splits are fixed: the contraction chunks and the LM head's column
# tiles are laid out so that a "model" axis of any size dividing MODEL_PARTS (1, 2, 4, 8)
# holds whole chunks or tiles on each device (`contraction_chunk`, `head_product`).
MODEL_PARTS = 8
# The longest contraction one product gets (`product`). Measured on XLA:CPU's own (Eigen)
# product with 8-64 rows: up to K = 128 a column's bits do not depend on the number of
# columns, in a process with one host device or eight; at K = 176 and 256 they changed
# with eight (its blocking splits K by the problem's shape there).
MAX_CHUNK = 128

# XLA:CPU options of a deterministic program: of the library fusions, which XLA:CPU picks
# by array size and which can take in the ops around them (a reduce, an `exp(x - max)`,
# elementwise code) with another order and another `exp`, only YNNPACK's individual dots
# stay: each is one product of a fixed tile shape, whose rows do not depend on each other
# (`tests/decoding/test_deterministic.py`, the tile-product test). And XLA:CPU's legacy
# loop emitters, not its newer fusion emitters: with those, a float32 Gemma 2 (hidden 32)
# generating one row alone rounded 15 of its 40 log-probs otherwise than the same rows in a
# batch of 5 (a decode step's elementwise code at batch 1 compiled otherwise; found by
# `tests/rl/test_token_logprobs.py`, -m slow); with the legacy emitters they are equal.
# And LLVM's default optimization level (XLA's default, 3), whatever XLA_FLAGS says: at -O0
# a LoRA row's float32 log-probs alone differed in the last bits from the same row in a
# batch of 4 (`tests/lora/test_lora.py`, the deterministic mixed batch); the test
# processes compile everything else at -O0 (the root `conftest.py`).
OPTIMIZED = {"xla_backend_optimization_level": 3}
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "xla_cpu_experimental_xnn_fusion_type": "",
    "xla_cpu_use_fusion_emitters": False,
} | OPTIMIZED
# Every backend's deterministic program: no excess precision. XLA's default
# (`xla_allow_excess_precision=true`) lets a bfloat16 value stay in float32 between two ops
# when they land in one fusion and be rounded to bfloat16 when they do not; the block's
# residual adds are fused one way inside the decode step's `while_loop` and another in a
# prompt or scoring pass, so bfloat16 log-probs of the same token differed by up to 0.008
# nats between `generate` and `score`. Off, every bfloat16 op rounds where the program
# says it does, whatever the fusion (float32 programs are unaffected).
EXACT_PRECISION_OPTIONS = {"xla_allow_excess_precision": False}
# ... and of a model-parallel-invariant one: YNNPACK's dots off too. YNNPACK's dot rounds a
# column differently with the number of columns in the call, and a model-parallel mesh
# gives each device a slice of them; XLA:CPU's own product of a fixed row tile with a
# contraction of at most MAX_CHUNK gives each entry the same bits whatever the number of
# columns (the tests of `product` and `tests/sharding/test_deterministic_mesh.py`).
CPU_SPLIT_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "",
    "xla_cpu_experimental_xnn_fusion_type": "",
} | OPTIMIZED


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics:
    """How a model computes its reductions: the numerics policy a runner carries (static
    and hashable, so it is part of every program's jit key) and hands to the model.

    deterministic: False (plain XLA ops), True (every reduction in an order fixed by the
      config: a row does not depend on the batch nor on a data axis) or MODEL_PARALLEL
      (also the splits of a model axis: contraction chunks, LM head tiles).
    tile_kernel: a deterministic policy's products as the Pallas tile kernel: None (XLA's
      dots in fixed row tiles), "pallas" (a GPU) or "interpret" (anywhere).
    unpadded: the (dtype name, head) pairs whose decode-pass products may run their rows
      unpadded, up to DECODE_TILE (what `calibrate`'s probes found on this CPU; `row_tile`).
    split_rows_keep_bits: whether this backend's model-parallel product gives a row of a
      DECODE_TILE-row tile the same bits at every place (`split_tiles_keep_row_bits`).
    prompt: the pass is (part of) a prompt pass (row tiles of PROMPT_TILE), not a decode
      step, a verification or the LM head (DECODE_TILE); set per call (`for_pass`).
    row_mesh: the mesh whose "data" axis holds the pass's rows, if any (each device tiles
      its own rows, `rowwise`; a paged pool's pages lie over it too,
      `layers.cached_attention`); set per call (`for_pass`), whatever the mode.
    prompt_rows: a packed pass (`ll.Packed`) whose first `prompt_rows` tokens are prompt
      tokens and the rest generated ones (a continuation scored): its products tile the
      first as a prompt pass and the rest as a decode step, each token as it would be in
      its own pass (`rowwise`); None otherwise. Set per call (`for_pass`).
    """

    deterministic: bool | str = False
    tile_kernel: str | None = None
    unpadded: frozenset[tuple[str, bool]] = frozenset()
    split_rows_keep_bits: bool = True
    prompt: bool = False
    row_mesh: Mesh | None = None
    prompt_rows: int | None = None

    def __post_init__(self):
        if self.deterministic not in (False, True) and self.deterministic != MODEL_PARALLEL:
            raise ValueError(
                f"deterministic must be True, False or {MODEL_PARALLEL!r}, "
                f"got {self.deterministic!r}"
            )
        if self.tile_kernel is not None and self.tile_kernel not in TILE_KERNELS:
            raise ValueError(
                f"tile_kernel must be None or one of {TILE_KERNELS}, got {self.tile_kernel!r}"
            )
        if self.unpadded and (self.deterministic is not True or self.tile_kernel is not None):
            raise ValueError(
                "unpadded decode rows are a finding of XLA:CPU's dots under deterministic=True "
                "without the tile kernel (calibrate's probe), not of this policy"
            )
        if self.tile_kernel is not None and self.deterministic is not True:
            raise ValueError(
                "the tile kernel runs deterministic=True only (it does not split a model "
                f"axis), got deterministic={self.deterministic!r}"
            )

    @property
    def fixed(self) -> bool:
        """Whether the reductions run in a fixed order (either deterministic mode)."""
        return bool(self.deterministic)

    @property
    def splits(self) -> bool:
        """Whether products also fix the splits of a model axis (MODEL_PARALLEL)."""
        return self.deterministic == MODEL_PARALLEL

    def for_pass(
        self, *, prompt: bool = False, mesh: Mesh | None = None, prompt_rows: int | None = None
    ) -> Numerics:
        """This policy for one forward pass: a prompt pass or not, the rows over `mesh`'s
        "data" axis or not, a packed pass of `prompt_rows` prompt tokens first or not."""
        if not self.fixed:  # only the rows' mesh matters (a paged pool's shards, `layers`)
            return self if mesh is None else dataclasses.replace(self, row_mesh=mesh)
        return dataclasses.replace(self, prompt=prompt, row_mesh=mesh, prompt_rows=prompt_rows)

    def compiler_options(self) -> dict[str, str]:
        """XLA options of this policy's programs on the default backend (none when plain)."""
        return compiler_options(self.splits) if self.fixed else {}


# Plain XLA ops: what every layer function computes unless given a deterministic policy.
PLAIN = Numerics()


def compiler_options(model_parallel: bool = False) -> dict[str, str]:
    """XLA options for a deterministic program on the default backend (`model_parallel`:
    a program whose products split in fixed chunks, `Numerics.splits`)."""
    if jax.default_backend() != "cpu":
        return dict(EXACT_PRECISION_OPTIONS)
    cpu = CPU_SPLIT_OPTIONS if model_parallel else CPU_COMPILER_OPTIONS
    return cpu | EXACT_PRECISION_OPTIONS
