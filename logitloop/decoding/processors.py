"""logitloop/decoding/processors.py (the lead's version wins at merge; copy it verbatim)."""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import struct

from logitloop.decoding.history import History


@struct.dataclass
class Step:
    """What a processor sees of the decode step: for every row [B] ..."""

    positions: jax.Array  # [B] i32: index among the row's generated tokens of the token drawn
    history: History | None  # prompt + generated tokens (None when the caller has none)
    done: jax.Array  # [B] bool: the row has stopped (its output is discarded)


class Processor(Protocol):
    """A pure per-row transform of the logits with per-row state.

    A processor is a pytree (a `flax.struct.dataclass`) whose array leaves all have a
    leading row axis [B, ...]. Class attribute `after_temperature = True` moves it from
    after step 3 (penalties) to after step 4 (temperature, on the scaled logits).
    """

    def init(self, batch_size: int, vocab_size: int) -> Any: ...

    def apply(self, state: Any, logits: jax.Array, step: Step) -> jax.Array: ...

    def update(self, state: Any, tokens: jax.Array, step: Step) -> Any: ...
