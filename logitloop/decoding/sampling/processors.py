"""Processors: user-written per-row transforms composed into the sampler and the loop.

A processor is a pytree (a `flax.struct.dataclass`) whose array leaves all have a leading
row axis `[B, ...]`: its per-row settings are data, so new values never recompile. It has
three methods:

    init(batch_size, vocab_size) -> state      # a pytree, every leaf [B, ...]
    apply(state, logits, step) -> logits       # [B, V] f32 -> [B, V] f32
    update(state, tokens, step) -> state       # after the row's token [B] i32 was drawn

Where it runs in the sampling order (`logitloop.decoding.sampling.sampler`): after the built-in
steps 1-3 (masks and bias, `min_tokens`, penalties) and before temperature, in list order.
A processor whose class sets `after_temperature = True` runs after step 4 instead, on the
temperature-scaled logits, before top-k, top-p and min-p.
One that sets `after_filters = True` runs last, after top-k, top-p and min-p: it sees the
scaled logits with the filtered-out tokens at -inf, and the row draws from what it returns
with no filter after it (typical sampling and the watermarks, as transformers orders
them after its other warpers).
Greedy rows (temperature 0 or top_k 1) are not scaled nor filtered, so there such a
processor sees the unscaled logits.

The processors travel inside `SamplingParams` (`params.processors`, a tuple), so everything
that selects, repeats, pads or places rows (`take`, `n > 1`, `generate_many`'s slots, a
mesh) maps over their leaves too: a processor author writes none of that. Their states
travel in the loop's state. A row that writes no token stops for good in that step, so
what `update` made of its state is never read again. On a mesh, the sampling
step then holds whole rows of the vocabulary on each device (processors see all of `V`).

A processor that sets every token of a row to -inf gives the row the defined all-masked
outcome (finish reason "error"), never NaN. NaN written by a processor counts as -inf (a
masked token); +inf gives the row the bad-logits outcome (finish reason "error" too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling.history import History


@struct.dataclass
class Step:
    """What a processor sees of the decode step, for every row [B]."""

    positions: jax.Array  # [B] i32: index among the row's generated tokens of the token drawn
    history: History | None  # prompt + generated tokens (None when the caller has none)
    done: jax.Array  # [B] bool: the row has stopped (its output is discarded)


class Processor(Protocol):
    """A pure per-row transform of the logits with per-row state (see the module docstring)."""

    def init(self, batch_size: int, vocab_size: int) -> Any: ...

    def apply(self, state: Any, logits: jax.Array, step: Step) -> jax.Array: ...

    def update(self, state: Any, tokens: jax.Array, step: Step) -> Any: ...


def after_temperature(processor: Any) -> bool:
    return bool(getattr(processor, "after_temperature", False))


def after_filters(processor: Any) -> bool:
    return bool(getattr(processor, "after_filters", False))


def place(processor: Any) -> str:
    """Where `processor` runs: "early" (before temperature), "late" (after it) or
    "filtered" (after top-k, top-p and min-p)."""
    if after_filters(processor):
        return "filtered"
    return "late" if after_temperature(processor) else "early"


def _name(i: int, processor: Any) -> str:
    return f"processors[{i}] ({type(processor).__name__})"


def check_rows(what: str, tree: Any, batch: int) -> None:
    """Every array leaf of `tree` has a leading row axis of length `batch`, or a ValueError
    naming `what` and the leaf."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != batch:
            raise ValueError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '(root)'} has shape {shape}; "
                f"every leaf needs a leading row axis of length {batch}"
            )


def as_tuple(processors: Sequence[Any] | None, batch: int) -> tuple[Any, ...]:
    """User `processors=` as the tuple `SamplingParams.processors` holds, checked."""
    if processors is None:
        return ()
    if not isinstance(processors, (list, tuple)):
        raise ValueError(f"processors must be a list of processors, got {type(processors)!r}")
    for i, p in enumerate(processors):
        for method in ("init", "apply", "update"):
            if not callable(getattr(p, method, None)):
                raise ValueError(f"{_name(i, p)} has no {method}() method")
        check_rows(_name(i, p), p, batch)
    return tuple(processors)


def init_states(processors: tuple[Any, ...], batch: int, vocab: int) -> tuple[Any, ...]:
    """Each processor's initial state, checked for its row axis (at trace time)."""
    states = tuple(p.init(batch, vocab) for p in processors)
    for i, (p, s) in enumerate(zip(processors, states, strict=True)):
        check_rows(f"{_name(i, p)}.init()", s, batch)
    return states


def apply_all(
    processors: tuple[Any, ...],
    states: tuple[Any, ...],
    logits: jax.Array,
    step: Step,
    *,
    where: str,
) -> jax.Array:
    """Run the processors of one place in the order (`where`: a `place`).

    Nothing else touches the logits here, so a trivial processor costs its own pass only:
    NaN is read as -inf (masked) by the steps after, and a row whose maximum is +inf gets
    the bad-logits outcome (`sampler.Processed.status`)."""
    for i, (p, s) in enumerate(zip(processors, states, strict=True)):
        if place(p) != where:
            continue
        out = p.apply(s, logits, step)
        if jnp.shape(out) != logits.shape:
            raise ValueError(
                f"{_name(i, p)}.apply() returned shape {jnp.shape(out)}, not the logits' "
                f"{logits.shape}"
            )
        logits = out.astype(jnp.float32)
    return logits


def update_all(
    processors: tuple[Any, ...], states: tuple[Any, ...], tokens: jax.Array, step: Step
) -> tuple[Any, ...]:
    return tuple(p.update(s, tokens, step) for p, s in zip(processors, states, strict=True))
