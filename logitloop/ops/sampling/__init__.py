"""Fused truncation (top-k, top-p, min-p) and draw: one dispatch over interchangeable backends.

`filter_and_sample(x, top_k, top_p, min_p, greedy, key, backend=...)` takes scaled logits
and returns the drawn tokens with their final log-probabilities and the thresholds used.
`backend="xla"` is the pure-JAX path (`xla.py`), which runs everywhere and is the reference
for the kernels.
"""

from logitloop.ops.sampling.dispatch import filter_and_sample
from logitloop.ops.sampling.xla import Draw, Thresholds

__all__ = ["Draw", "Thresholds", "filter_and_sample"]
