"""A `generate_many` job's captured residual streams (`capture=ll.Capture(...)`,
docs/inside.md): the slots' buffers, sized and checked before anything runs, and each
finished row's states, cut as `generate` cuts a row's (`inside.row_states`).

The capture is the job's, as `generate`'s is the call's: every request's rows record the
layers `Capture.layers` names, a static set (a new set compiles the loop once; a second
job of the same set and bounds compiles nothing). The slots hold `[S, P, C, E]` prompt
states (with `Capture(prompt=True)`) and `[S, N, C, E]` generated ones, float32. A row's
prefill writes its slot's (the prompt's columns, and generated column 0, the states at its
last prompt token), and each decode step writes each running row's states at that row's
own column, its `num_tokens`: the slots' rows entered at different steps, so the loop
scatters (`Program.capture_scatter`) where `generate`'s rows, which all started together,
share one column. A finished row's states are read back by slot, before the slot is
refilled.

Prompt capture and the prefix cache: a row that reads a cached page runs none of its
tokens through the model, so no pass computes their states, and recomputing them would
cost the prefill the cache saves. `Capture(prompt=True)` therefore prefills every prompt
whole, for each of a request's `n` rows too: the job's `prefix_cache` defaults to False,
`prefix_cache=True` is refused by name, and on a pool (`kv_cache_tokens`) every row owns
its pages. Without `prompt=True` the prefix cache runs as ever: a row's prefill always computes
its prompt's last token, whose states draw its first token. A preempted row keeps its
states; its resumption recomputes keys and values only (`pool.resume`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine.inside import check_capture_size, row_states
from logitloop.models.kv import Rows


def prefix_cache(options: Any, prefix_cache: bool | None) -> bool | None:
    """The job's `prefix_cache` under its `capture=` (module docstring): False by default
    with `Capture(prompt=True)`, which refuses True by name; else as given."""
    if shares_prompts(options):
        return prefix_cache
    if prefix_cache:
        raise ValueError(
            "prefix_cache=True with capture=ll.Capture(prompt=True): a row that reads cached "
            "prompt pages computes no states for their tokens; leave prefix_cache unset "
            "(prompt capture prefills every prompt whole) or capture with prompt=False"
        )
    return False


def shares_prompts(options: Any) -> bool:
    """Whether the job's rows may share prompt pages (a request's `n` rows, the prefix
    cache): not under `Capture(prompt=True)` (module docstring)."""
    return options.capture is None or not options.capture.prompt


def scattering(plan: Any) -> Any:
    """`plan` whose loop writes each row's captured states at its own column (rows enter
    at different steps), unchanged without `capture=`."""
    if plan.options.capture is None:
        return plan
    return dataclasses.replace(
        plan, program=dataclasses.replace(plan.program, capture_scatter=True)
    )


class JobCapture:
    """The layers a job captures and the slots' buffers' shape (module docstring), the
    buffers' size checked: `slots` x (`prompt_len` with `Capture(prompt=True)`, +
    `buffer_len`) x C x E float32 values (`inside.check_capture_size`)."""

    def __init__(self, plan: Any, slots: int, prompt_len: int, buffer_len: int):
        capture = plan.options.capture
        self.prompt = capture.prompt
        self.layers = capture.model_layers(plan.num_layers)
        width = plan.info.residual_width or _traced_width(plan.info, self.layers)
        check_capture_size(capture, len(self.layers), slots, prompt_len, buffer_len, width)
        self.shape = (len(self.layers), width)  # (C, E)

    def fetch(self, state: Any, slots: Sequence[int]) -> list[tuple]:
        """The captured states of `slots`, host arrays: (prompt [1, P, C, E] or None,
        generated [1, N, C, E]) each."""
        return jax.device_get([_slot(state.capture, np.int32(slot)) for slot in slots])

    def rows(
        self, fetched: Sequence[tuple], ids: Sequence[list[int]], num_tokens: Sequence[int]
    ) -> list[np.ndarray]:
        """Each row's `[T, C, E]` states (`ll.Capture`) from its `fetch`ed buffers, its
        prompt `ids` and the tokens it generated."""
        return [
            row_states(f, [i], [n], self.prompt)[0]
            for f, i, n in zip(fetched, ids, num_tokens, strict=True)
        ]


def for_job(plan: Any, slots: int, prompt_len: int, buffer_len: int) -> JobCapture | None:
    """The capture of a job of `slots` slots and these buckets, None without `capture=`."""
    if plan.options.capture is None:
        return None
    return JobCapture(plan, slots, prompt_len, buffer_len)


def empty(program: Any, shape: tuple[int, int] | None, state: Any) -> tuple | None:
    """The empty buffers (`DecodeState.capture`; traced) of the slots of `state` (empty
    slots), `shape` (C, E); None without `program.capture`."""
    if not program.capture:
        return None
    batch, buffer_len = state.tokens.shape
    zeros = lambda n: jnp.zeros((batch, n, *shape), jnp.float32)  # noqa: E731
    prompt_len = state.history.tokens.shape[1] - buffer_len
    return (zeros(prompt_len) if program.capture_prompt else None), zeros(buffer_len)


@jax.jit
def _slot(capture: tuple, slot: jax.Array) -> tuple:
    """One slot's rows of the buffers (one program per buffer shape, whatever the slot)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, keepdims=True), capture)


def _traced_width(info: Any, layers: tuple[int, ...]) -> int:
    """A user's model's residual width, which it says only when it runs: the last axis of
    the states a one-token pass captures, traced (nothing runs or compiles)."""
    runner = info.runner

    def one(weights):
        token = jnp.zeros((1, 1), jnp.int32)
        cache = runner.init_cache(weights, 1, 1)
        return runner.forward(weights, token, token, cache, prompt=True, rows=Rows(capture=layers))

    return int(jax.eval_shape(one, info.weights)[-1].shape[-1])
