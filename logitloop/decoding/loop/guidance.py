"""Classifier-free guidance inside the decode loop: a guided row and its negative row.

A guided row r (`generate(..., guidance_scale=s, negative_prompt=...)`) has a row of its
own for the negative context, `negative[r]`, elsewhere in the same batch (the host puts
the negative rows after the real ones: `logitloop.decoding.engine.guidance`). Both rows
run through the model at every step, each with its own cache and positions; at each
sampling step (`decode_loop.sample_state`: prefill, decode):

1. the guided row's scores become, on log-softmaxed float32 logits,
   `scale * (cond - uncond) + uncond` with cond its own and uncond its negative row's
   (transformers' `UnbatchedClassifierFreeGuidanceLogitsProcessor`, which runs first
   among the processors): every filter, penalty and processor then acts on these scores,
   and the row's `raw_logprobs` are their log-softmax;
2. every row draws as usual (`sampler.sample_step`);
3. a negative row takes its guided row's token and status (`follow`), so its context
   grows by the tokens its guided row writes; after `record` it takes the guided row's
   finish too (`follow_finish`), so the two stop together and the negative row never
   holds the loop open.

On a paged pool (`generate_many`) a row refused a page holds its partner back too
(`together`), so the pair never falls out of step.

Rows without guidance are their own negative and parent, with scale 1: step 1 leaves
their logits as they are (they pay the [B, V] select of step 1, nothing else), and
step 3 leaves their token as drawn. A batch where no row is guided carries no
`Guidance` at all (`Tables.guidance` None): its program is the plain loop's.

Worked example, 2 prompts, prompt 1 guided, n = 1, row bucket 4:

    row      0      1          2 (prompt 1's negative)   3 (dummy)
    scale    1      s          1                          1
    negative 0      2          2                          3
    parent   0      1          1                          3
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.decoding.sampling.sampler import SampleOutput


@struct.dataclass
class Guidance:
    """Each row's guidance, read by the loop and never written (`Tables.guidance`), R rows."""

    scale: jax.Array  # [R] f32, a guided row's scale; 1 on every other row
    negative: jax.Array  # [R] i32, a guided row's negative row; else the row itself
    parent: jax.Array  # [R] i32, a negative row's guided row; else the row itself


def guide(guidance: Guidance, logits: jax.Array) -> jax.Array:
    """[R, V] logits -> [R, V] f32 scores: each guided row's `scale * (cond - uncond) +
    uncond` on log-softmaxed logits (transformers' order of operations), every other row's
    logits as they are."""
    rows = jnp.arange(logits.shape[0])
    cond = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R, V]
    uncond = cond[guidance.negative]  # [R, V]
    scores = guidance.scale[:, None] * (cond - uncond) + uncond
    guided = (guidance.negative != rows)[:, None]  # [R, 1]
    return jnp.where(guided, scores, logits.astype(jnp.float32))


def follow(guidance: Guidance, out: SampleOutput) -> SampleOutput:
    """The sampling step's output with each negative row's token and status its guided
    row's (the negative row's own draw is dropped)."""
    return out.replace(tokens=out.tokens[guidance.parent], status=out.status[guidance.parent])


def follow_finish(guidance: Guidance, state):
    """The `DecodeState` with each negative row's done, finish and match its guided row's
    (equal already when the two rows' stop rules are the same; this makes it so)."""
    p = guidance.parent
    return state.replace(done=state.done[p], finish=state.finish[p], matched=state.matched[p])


def together(guidance: Guidance, state, live: jax.Array):
    """A paged pool's step (`pool.grow`): `live` ([R] bool, the rows granted their page)
    with a guided row and its negative row held back together when either was refused,
    and the one held back marked stalled (the host preempts the pair together,
    `generate_many`'s `job_guidance`): the two feed the same tokens at every step."""
    both = live & live[guidance.negative] & live[guidance.parent]
    pool = state.pages
    return state.replace(pages=pool.replace(stalled=pool.stalled | (live & ~both))), both
