"""Attention over a KV cache: one dispatch function, `attention`, and its implementations.

- `reference.py`: the one-einsum attention (the tests' reference) and `Mask`, the mask as
  positions that every implementation shares.
- `blockwise.py`: key and query blocks with an online softmax; temporaries linear in T.
- `fixed_order.py`: every sum in a fixed order (the deterministic modes' "fixed-order").
- `api.py`: `attention(..., implementation="auto")` and the choice it makes (`choose`,
  `describe`).
- `splash.py`: a whole prompt on a TPU through jax's splash attention Pallas kernel
  (imported by `attention` when it runs "splash").
- `paged.py`: decode attention over a paged KV cache (a gather reference, a Pallas kernel
  that reads each row's live pages only, `paged_attention`'s dispatch); imported by whoever
  uses it, since Pallas is slow to import.
"""

from logitloop.ops.attention.api import (
    IMPLEMENTATIONS,
    attention,
    choose,
    decode_attention,
    dense_attention,
    describe,
)
from logitloop.ops.attention.blockwise import blockwise_attention
from logitloop.ops.attention.reference import MASK_VALUE, Mask, reference_attention, soft_cap

__all__ = [
    "IMPLEMENTATIONS",
    "MASK_VALUE",
    "Mask",
    "attention",
    "blockwise_attention",
    "choose",
    "decode_attention",
    "dense_attention",
    "describe",
    "reference_attention",
    "soft_cap",
]
