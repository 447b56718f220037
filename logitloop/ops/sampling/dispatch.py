"""The sampling operator's one entry point: every backend behind one signature.

`backend="xla"` runs the pure-JAX path (`xla.py`) on any platform; `backend="pallas"` runs
the fused Pallas GPU kernel (`pallas.py`); `backend="sharded"` runs the XLA path under
`shard_map` with the vocabulary split over a mesh axis (`sharded.py`; needs `mesh=`);
`backend="auto"` picks the kernel when JAX's default backend is a GPU and the XLA path
otherwise. `reference.py` beside them is the sort-based reference every backend is tested
against. The choice is made while tracing, so it costs nothing at run time.
`interpret=True` runs the kernel in Pallas interpret mode (any platform, slow; for tests).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from logitloop.ops.sampling import sharded, xla

BACKENDS = ("auto", "xla", "pallas", "sharded")


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, else "xla"; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def filter_and_sample(
    x,
    top_k,
    top_p,
    min_p,
    greedy,
    key,
    *,
    backend: str = "auto",
    temperature: jax.Array | None = None,
    interpret: bool = False,
    mesh: Mesh | None = None,
    axis: str = "model",
    batch_axis: str | None = None,
) -> tuple[xla.Draw, xla.Thresholds]:
    """Truncate each row by its own top-k/top-p/min-p and draw one token.

    x: [B, V] logits, already scaled, or unscaled with `temperature` ([B]; 0 on greedy rows
    leaves them unscaled): the same tokens either way (`xla.scale_logits`). See
    `xla.filter_and_sample` for the contract every backend keeps; `mesh`, `axis` and
    `batch_axis` lay out the `sharded` backend.
    """
    backend = resolve_backend(backend)
    if backend == "xla":
        return xla.filter_and_sample(x, top_k, top_p, min_p, greedy, key, temperature=temperature)
    x = xla.scale_logits(x, temperature)
    if backend == "pallas":
        # Imported here: Pallas and its Triton lowering take a tenth of a second to import,
        # and only a GPU (or a test in interpret mode) runs the kernel.
        from logitloop.ops.sampling import pallas

        return pallas.filter_and_sample_pallas(
            x, top_k, top_p, min_p, greedy, key, interpret=interpret
        )
    if mesh is None:
        raise ValueError('backend = "sharded" needs mesh=, a jax.sharding.Mesh')
    return sharded.filter_and_sample_sharded(
        x, top_k, top_p, min_p, greedy, key, mesh=mesh, axis=axis, batch_axis=batch_axis
    )
