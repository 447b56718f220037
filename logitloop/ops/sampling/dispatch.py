"""Backend choice for the sampling operator, kept in one place."""

from __future__ import annotations

from logitloop.ops.sampling import xla

BACKENDS = ("auto", "xla")


def filter_and_sample(x, top_k, top_p, min_p, greedy, key, *, backend: str = "auto"):
    """See `logitloop.ops.sampling.xla.filter_and_sample`; `backend` picks the implementation."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    return xla.filter_and_sample(x, top_k, top_p, min_p, greedy, key)
