"""The quantized tests' independent reference: a Qwix `QArray`'s float64 value computed
with NumPy only (integer or fp8 values times their scales repeated over each scale's
tile), without Qwix's own dequantize."""

import jax.numpy as jnp
import numpy as np


def dequantized(q) -> np.ndarray:
    values = np.asarray(q.qvalue.astype(jnp.float32), np.float64)  # exact for int and fp8
    scale = np.asarray(q.scale, np.float64)
    for axis, (n, s) in enumerate(zip(values.shape, scale.shape, strict=True)):
        scale = np.repeat(scale, n // s, axis=axis)
    return values * scale
