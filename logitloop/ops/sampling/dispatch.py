"""Backend choice for the sampling operator, kept in one place.

`backend="xla"` runs the pure-JAX path (`xla.py`) on any platform; `backend="pallas"` runs
the fused Pallas GPU kernel (`pallas.py`); `backend="auto"` picks the kernel when JAX's
default backend is a GPU and the XLA path otherwise. The choice is made while tracing, so
it costs nothing at run time. `interpret=True` runs the kernel in Pallas interpret mode
(any platform, slow; for tests) and has no effect on the XLA path.
"""

from __future__ import annotations

import jax

from logitloop.ops.sampling import pallas, xla

BACKENDS = ("auto", "xla", "pallas")


def resolve_backend(backend: str) -> str:
    """ "auto" -> "pallas" on GPU, else "xla"; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def filter_and_sample(
    x, top_k, top_p, min_p, greedy, key, *, backend: str = "auto", interpret: bool = False
):
    """See `logitloop.ops.sampling.xla.filter_and_sample`; `backend` picks the implementation."""
    if resolve_backend(backend) == "pallas":
        return pallas.filter_and_sample_pallas(
            x, top_k, top_p, min_p, greedy, key, interpret=interpret
        )
    return xla.filter_and_sample(x, top_k, top_p, min_p, greedy, key)
