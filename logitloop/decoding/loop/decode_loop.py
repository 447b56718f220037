"""The device loop: the state it carries, one-pass prefill, and the decode `while_loop`.

Index bookkeeping, for one row with prompt [a, b, c] in a batch whose prompts are bucketed to
P = 4 columns and whose generation buffer holds N tokens:

    prefill tokens     [pad, a, b, c]     positions [-1, 0, 1, 2]
    cache slots        0:a 1:b 2:c        (the pad is never written)
    logits of column 3 -> token t0, generated index 0, random stream (seed, 0)
    step 1 feeds t0 at position 3 -> t1 (index 1), step 2 feeds t1 at position 4 -> t2, ...

so the token generated at index i is fed back at position `prompt_len + i`, and the cache
needs `P + N` slots. A row stops after the token that matches one of its stop conditions;
from then on the loop leaves its slots, cache and counters untouched.

Everything here is traced once per shape and runs on device; the host side (prompts,
padding, results) is `logitloop.decoding.engine.host`. Where the arrays live is a static `layout`
argument (`logitloop.decoding.loop.layout`: one device by default, `sharding.MeshLayout` on a
mesh).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.loop import guidance, repetition, stop_strings
from logitloop.decoding.loop import pool as paged
from logitloop.decoding.loop.guidance import Guidance
from logitloop.decoding.loop.layout import ONE_DEVICE, Layout
from logitloop.decoding.loop.runner import ModelRunner, runner_jit
from logitloop.decoding.loop.stop_strings import StopStrings
from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.constraints import Automata
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.decoding.sampling.sampler import STATUS_OK, SampleOutput
from logitloop.models.kv import Rows

# finish codes, per row
RUNNING = 0
FINISH_STOP_TOKEN = 1
FINISH_STOP_SEQUENCE = 2
FINISH_LENGTH = 3
FINISH_ERROR = 4
FINISH_STOP_STRING = 5
FINISH_CONSTRAINT = 6  # the row's automaton allows nothing but EOS: its document is complete
FINISH_REPETITION = 7  # the repetition guard: the row's last tokens repeat (`repetition`)


@dataclasses.dataclass(frozen=True)
class Program:
    """The static part of a call, which the loop's programs are compiled against (hashable).

    runner: the model's forward pass; layout: where the arrays live (one device or a mesh);
    speculative: a resolved speculation strategy (`speculative.resolve`), or None;
    pool: a paged cache's `pool.PoolShape` (`generate_many`'s `kv_cache_tokens`), or None.
    """

    runner: ModelRunner
    layout: Layout = ONE_DEVICE
    speculative: Any = None
    pool: Any = None
    # Record each token's experts (`generate(..., return_routing=True)`, a mixture of
    # experts): the state then carries `routing`; without it the loop carries nothing more.
    routing: bool = False
    # Record the residual stream at the layers `Tables.rows.capture` names (`generate(...,
    # capture=)`): the state then carries `capture`; `capture_prompt`: at the prompt's
    # tokens too, not only at the tokens that predict the generated ones; `capture_scatter`:
    # rows entered at different steps (`generate_many`'s slots), so each row's states go to
    # its own column (a scatter), not to the one column every row of `generate` shares.
    capture: bool = False
    capture_prompt: bool = False
    capture_scatter: bool = False


@struct.dataclass
class Tables:
    """What the loop reads at every step and never writes (device arrays, B rows).

    weights: the model's; params: the rows' `SamplingParams` (device part); stops: the rows'
    stop-string tables; automata: the constraints' tables; draft_weights: a draft model's;
    rows: the rows' per-row model state (`ll.Rows`: each row's LoRA adapter and the
    adapter table), which every target pass gets (`ModelRunner.forward`), or None;
    guidance: classifier-free guidance's rows (`guidance.Guidance`), or None.
    """

    weights: Any
    params: SamplingParams
    stops: StopStrings | None = None
    automata: Automata | None = None
    draft_weights: Any = None
    rows: Rows | None = None
    guidance: Guidance | None = None


@struct.dataclass
class PromptBatch:
    """Prompts laid out for `prefill` (see the module docstring), B rows."""

    prompt: jax.Array  # [B, P] i32, left-padded
    positions: jax.Array  # [B, P] i32, -1 on padding
    lengths: jax.Array  # [B] i32
    history: History  # [B, P + N]: each prompt from column 0, -1 after

    @property
    def cache_len(self) -> int:
        return self.history.tokens.shape[1]

    def whole(self, width: int) -> tuple[jax.Array, jax.Array]:
        """Each whole prompt left-padded to `width` columns, rebuilt from `history`, and its
        positions, as `host.prompt_batch` lays them out: the batch again after
        `host.suffix_batch` cut it to the columns after shared pages."""
        pos = jnp.arange(width)[None, :] - (width - self.lengths)[:, None]  # [B, width]
        at = jnp.clip(pos, 0, self.cache_len - 1)
        tokens = jnp.take_along_axis(self.history.tokens, at, axis=1)
        return jnp.where(pos >= 0, tokens, 0), jnp.where(pos >= 0, pos, -1).astype(jnp.int32)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries from one step to the next.

    B rows, N = generation buffer length, P + N cache slots, L = longest stop sequence.
    """

    step: jax.Array  # [] i32, loop iterations run (tokens drawn after the first)
    done: jax.Array  # [B] bool, the row has stopped; it never changes again
    finish: jax.Array  # [B] i32, RUNNING or a FINISH_* code
    # [B] i32, the stop token id, stop-sequence or stop-string index that matched, or the
    # repeated period (FINISH_REPETITION), else -1
    matched: jax.Array
    tokens: jax.Array  # [B, N] i32, generated tokens, -1 past num_tokens
    num_tokens: jax.Array  # [B] i32, tokens generated so far
    logprobs: jax.Array  # [B, N] f32, log-prob under the final distribution
    raw_logprobs: jax.Array  # [B, N] f32, log-softmax of the model's logits
    top_ids: jax.Array  # [B, N, K] i32, K = the params' top_logprobs_width
    top_values: jax.Array  # [B, N, K] f32
    prompt_len: jax.Array  # [B] i32
    cache: Any  # the model's KV cache, P + N slots per row
    history: History  # prompt + generated tokens, for the penalties
    window: jax.Array  # [B, L] i32, the last L generated tokens (stop sequences), -1 before
    text_window: jax.Array  # [B, W] i32, the last W bytes of generated text (stop strings)
    # [B, P] i32, per period p = 1..P the trailing tokens equal to the one p back (the
    # repetition guard, `repetition`); P = MAX_GUARD_PERIOD
    repeat_runs: jax.Array
    processor_states: tuple = ()  # one state per `params.processors`, every leaf [B, ...]
    fsm: jax.Array | None = None  # [B] i32, each row's automaton state (-1 = unconstrained)
    # Speculative decoding's own per-row state (`speculative.SpecState`), None without it.
    speculation: Any = None
    # A paged cache's page bookkeeping (`pool.Pool`; `cache` is then the shared pool), or None.
    pages: Any = None
    # `Program.routing`: the experts each token went to, (prompt [B, P, L, k], generated
    # [B, N, L, k]) i32, -1 where none (padding; a generated token never fed back); else None.
    routing: Any = None
    # `Program.capture`: the residual stream at the captured layers, (prompt [B, P, C, E]
    # or None without `capture_prompt`, generated [B, N, C, E]); generated column i holds
    # the states at the token whose logits drew token i (the prompt's last for i = 0, else
    # generated token i - 1 fed back), so every generated token has its column. Else None.
    capture: Any = None

    @classmethod
    def empty(
        cls,
        *,
        cache: Any,
        history: History,
        prompt_len: jax.Array,
        buffer_len: int,
        num_top: int,
        window: int,
        text: int,
        processor_states: tuple = (),
        fsm: jax.Array | None = None,
        done: bool = False,
    ) -> DecodeState:
        """Rows with nothing generated yet (`done=True`: empty slots the loop never runs).

        `fsm`: [B] the rows' initial automaton states (default: every row unconstrained)."""
        batch = prompt_len.shape[0]
        return cls(
            step=jnp.zeros((), jnp.int32),
            done=jnp.full((batch,), done),
            finish=jnp.zeros((batch,), jnp.int32),
            matched=jnp.full((batch,), -1, jnp.int32),
            tokens=jnp.full((batch, buffer_len), -1, jnp.int32),
            num_tokens=jnp.zeros((batch,), jnp.int32),
            logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
            raw_logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
            top_ids=jnp.full((batch, buffer_len, num_top), -1, jnp.int32),
            top_values=jnp.full((batch, buffer_len, num_top), -jnp.inf, jnp.float32),
            prompt_len=prompt_len,
            cache=cache,
            history=history,
            window=jnp.full((batch, window), -1, jnp.int32),
            text_window=jnp.full((batch, text), stop_strings.SENTINEL, jnp.int32),
            repeat_runs=repetition.empty_runs(batch),
            processor_states=tuple(processor_states),
            fsm=jnp.full((batch,), -1, jnp.int32) if fsm is None else jnp.asarray(fsm, jnp.int32),
        )

    def outputs(self) -> Outputs:
        """What the host reads back from the state."""
        return Outputs(
            tokens=self.tokens,
            num_tokens=self.num_tokens,
            finish=self.finish,
            matched=self.matched,
            logprobs=self.logprobs,
            raw_logprobs=self.raw_logprobs,
            top_ids=self.top_ids,
            top_values=self.top_values,
        )


@struct.dataclass
class Outputs:
    """The per-row results of a `DecodeState` (on device, or numpy after `jax.device_get`)."""

    tokens: Any  # [B, N] i32
    num_tokens: Any  # [B] i32
    finish: Any  # [B] i32
    matched: Any  # [B] i32
    logprobs: Any  # [B, N] f32
    raw_logprobs: Any  # [B, N] f32
    top_ids: Any  # [B, N, K] i32
    top_values: Any  # [B, N, K] f32

    def take(self, rows: Any) -> Outputs:
        return jax.tree.map(lambda x: x[rows], self)

    @staticmethod
    def concat(parts: list[Outputs]) -> Outputs:
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)


def sample_state(
    layout: Layout,
    tables: Tables,
    logits: jax.Array,
    state: DecodeState,
    *,
    where: jax.Array | None = None,
    choose: Any = None,
) -> DecodeState:
    """Draw each row's next token from `logits` [B, V] and `record` it: the one sampling
    step of prefill, decode and speculative verification (the constraints' masks from the
    rows' automaton states; `where`, `choose`: see `record` and `sampler.sample_step`).
    With `tables.guidance`, guided rows draw from their guided scores and negative rows
    follow them (`logitloop.decoding.loop.guidance`)."""
    params, automata, guided = tables.params, tables.automata, tables.guidance
    if guided is not None:
        logits = guidance.guide(guided, logits)
    bits = None if automata is None else constraints.row_bits(automata, state.fsm)
    out = layout.sample(
        logits,
        params,
        state.num_tokens,
        state.history,
        state.processor_states,
        state.done,
        allowed_bits=bits,
        choose=choose,
    )
    if guided is None:
        return record(state, out, params, tables.stops, automata, bits, where=where)
    out = guidance.follow(guided, out)
    state = record(state, out, params, tables.stops, automata, bits, where=where)
    return guidance.follow_finish(guided, state)


def first_state(
    layout: Layout,
    tables: Tables,
    logits: jax.Array,
    cache: Any,
    history: Any,
    prompt_len: jax.Array,
    buffer_len: int,
    num_top: int,
    fsm: Any,
) -> DecodeState:
    """The state after a prefill: the rows' `cache`, prompt `history` and `prompt_len` [B],
    their first tokens drawn from the prompts' last `logits` [B, V] (`sample_state`)."""
    state = DecodeState.empty(
        cache=cache,
        history=history,
        prompt_len=prompt_len,
        buffer_len=buffer_len,
        num_top=num_top,
        window=tables.params.stop_sequences.shape[2],
        text=0 if tables.stops is None else tables.stops.window,
        processor_states=procs.init_states(tables.params.processors, *logits.shape),
        fsm=fsm,
    )
    return sample_state(layout, tables, logits, state)


def push_token(window: jax.Array, tok: jax.Array) -> jax.Array:
    """The window of the last L generated tokens [B, L] after appending `tok` [B]."""
    return jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)


def sequence_hits(
    seqs: jax.Array,  # [B, Q, L] i32, stop sequences right-aligned, -1 padded
    window: jax.Array,  # [B, L] i32, the last L generated tokens, the new one included
    num_tokens: jax.Array,  # [B] i32, tokens generated, the new one included
    min_tokens: jax.Array,  # [B] i32
) -> jax.Array:
    """[B, Q] bool: stop sequence q ends at the new token (and the row has min_tokens)."""
    hit = jnp.all((seqs < 0) | (seqs == window[:, None, :]), axis=2) & jnp.any(seqs >= 0, axis=2)
    return hit & (num_tokens >= min_tokens)[:, None]


def record(
    state: DecodeState,
    out: SampleOutput,
    params: SamplingParams,
    stops: StopStrings | None,
    automata: Automata | None = None,
    bits: jax.Array | None = None,
    where: jax.Array | None = None,
) -> DecodeState:
    """Append each running row's new token and check its stop conditions.

    `automata`, `bits`: the constraints' tables and the masks the token was drawn under
    (`constraints.row_bits` of the rows' states); each written token advances its row's
    automaton, and a row whose automaton can then only end finishes (FINISH_CONSTRAINT).
    `where` ([B] bool): only these rows take their token; the others stay as they are,
    processor states included (speculative verification records one draft column at a
    time, for the rows still accepting).
    """
    batch, buf = state.tokens.shape
    active = ~state.done if where is None else ~state.done & where
    ok = out.status == STATUS_OK
    write = active & ok
    rows = jnp.arange(batch)
    col = jnp.where(write, state.num_tokens, buf)  # out of range -> dropped
    tok = out.tokens

    def put(arr, val):
        return arr.at[rows, col].set(val, mode="drop")

    num_tokens = state.num_tokens + write.astype(jnp.int32)
    window = jnp.where(write[:, None], push_token(state.window, tok), state.window)

    # Stop token ids (EOS included by the caller).
    hit_token = jnp.any(params.stop_token_ids == tok[:, None], axis=1)
    seq_hit = sequence_hits(params.stop_sequences, window, num_tokens, params.min_tokens)
    hit_seq = jnp.any(seq_hit, axis=1)
    hit_len = num_tokens >= params.max_tokens
    tokens = put(state.tokens, tok)
    runs, period = repetition.guard(
        state.repeat_runs, tokens, num_tokens, write, params.guard_period, params.guard_repeats
    )
    hit_rep = (period > 0) & (num_tokens >= params.min_tokens)
    text_window = state.text_window
    if stops is None:
        hit_str = jnp.zeros_like(hit_seq)
        which_str = jnp.zeros_like(state.matched)
    else:
        text_window, hit_str, which_str = stop_strings.advance(text_window, stops, tok, write)
        hit_str = hit_str & (num_tokens >= params.min_tokens)
    fsm = state.fsm
    if automata is None:
        hit_end = jnp.zeros_like(hit_seq)
    else:
        fsm = constraints.advance(automata, fsm, bits, tok, write)
        hit_end = constraints.can_only_end(automata, fsm)

    finish = jnp.where(
        ~ok,
        FINISH_ERROR,
        jnp.where(
            hit_token,
            FINISH_STOP_TOKEN,
            jnp.where(
                hit_seq,
                FINISH_STOP_SEQUENCE,
                jnp.where(
                    hit_str,
                    FINISH_STOP_STRING,
                    jnp.where(
                        hit_end,
                        FINISH_CONSTRAINT,
                        jnp.where(
                            hit_rep, FINISH_REPETITION, jnp.where(hit_len, FINISH_LENGTH, RUNNING)
                        ),
                    ),
                ),
            ),
        ),
    )
    finish = jnp.where(active, finish, state.finish)
    matched = jnp.where(
        hit_token,
        tok,
        jnp.where(
            hit_seq,
            jnp.argmax(seq_hit, axis=1),
            jnp.where(hit_str, which_str, jnp.where(hit_end, -1, jnp.where(hit_rep, period, -1))),
        ),
    ).astype(jnp.int32)
    matched = jnp.where(active & ok, matched, state.matched)

    states = out.states
    if where is not None:
        states = jax.tree.map(
            lambda new, old: jnp.where(write.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
            states,
            state.processor_states,
        )
    top_ids, top_values = state.top_ids, state.top_values
    if top_ids.shape[2]:
        top_ids = put(top_ids, out.top_logprobs.ids)
        top_values = put(top_values, out.top_logprobs.values)
    return state.replace(
        done=state.done | (finish != RUNNING),
        finish=finish.astype(jnp.int32),
        matched=matched,
        tokens=tokens,
        num_tokens=num_tokens,
        logprobs=put(state.logprobs, out.logprobs),
        raw_logprobs=put(state.raw_logprobs, out.raw_logprobs),
        top_ids=top_ids,
        top_values=top_values,
        history=state.history.append(tok, where=write),
        window=window,
        text_window=text_window,
        repeat_runs=runs,
        fsm=fsm,
        # Without `where`, rows that wrote no token are done from here on: their states are
        # never read again.
        processor_states=states,
    )


def forward_prompt(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    cache_len: int,
    layout: Layout = ONE_DEVICE,
    chunk: int | None = None,
    cache: Any = None,
    routing: jax.Array | None = None,
    rows: Rows | None = None,
) -> tuple[jax.Array, ...]:
    """The model over whole prompts: next-token logits [B, V] and the cache.

    One pass, or with `chunk` the columns `chunk` at a time, each call attending the
    cache the earlier ones wrote (as a decode step does). `cache`: the cache to write
    (a paged pool attached to the rows' tables); default a fresh one. `routing` ([B, P,
    L, k], a mixture of experts): experts to replay (-1: the router's own); the routing
    used then comes back third. `rows`: the rows' per-row state (`Tables.rows`); where it
    captures layers, their states `[B, P, C, E]` come back last.
    """
    batch, width = prompt.shape
    if cache is None:
        cache = layout.cache(runner.init_cache(weights, batch, cache_len), batch)
    step = width if chunk is None else chunk
    extras = []  # per chunk: the routing used and/or the captured states
    for start in range(0, width, step):
        cols = slice(start, start + step)
        routed = {} if routing is None else {"routing": routing[:, cols]}
        logits, cache, *got = runner.forward(
            weights, prompt[:, cols], positions[:, cols], cache, prompt=True,
            mesh=layout.row_mesh, rows=rows, **routed,
        )  # fmt: skip
        extras.append(got)
    return (logits, cache, *(jnp.concatenate(x, axis=1) for x in zip(*extras, strict=True)))


@functools.partial(
    runner_jit, static_argnames=("program", "buffer_len", "num_top", "prefill_chunk")
)
def prefill(
    program: Program,
    tables: Tables,  # [B] rows
    prompts: PromptBatch,  # [B, P] prompts, left-padded, and their histories [B, P + N]
    fsm: jax.Array | None = None,  # [B] i32, the rows' initial automaton states
    cache: Any = None,  # the cache to write (default a fresh one; see `forward_prompt`)
    *,
    buffer_len: int,
    num_top: int,
    prefill_chunk: int | None = None,
) -> DecodeState:
    """Run the whole prompt in one forward pass (or `prefill_chunk` columns at a time) and
    draw each row's first token.

    With `program.speculative`, the state also gets speculation's per-row state (a draft
    model's prefill included: `speculative.init`).
    """
    layout = program.layout
    batch, plen = prompts.prompt.shape
    prompts, params, fsm = layout.rows((prompts, tables.params, fsm), batch)
    tables = tables.replace(params=params)
    prompt, positions = prompts.prompt, prompts.positions
    runner = program.runner
    routing = runner.no_routing(tables.weights, batch, plen) if program.routing else None
    logits, cache, *used = forward_prompt(
        runner, tables.weights, prompt, positions, plen + buffer_len, layout,
        prefill_chunk, cache, routing, tables.rows,
    )  # fmt: skip
    state = first_state(
        layout, tables, logits, cache, prompts.history, prompts.lengths, buffer_len, num_top, fsm
    )
    if program.routing:
        prompt_routing = jnp.where(positions[:, :, None, None] >= 0, used[0], -1)
        generated = runner.no_routing(tables.weights, batch, buffer_len)
        state = state.replace(routing=(prompt_routing, generated))
    if program.capture:
        state = state.replace(capture=first_capture(program, used[-1], buffer_len))
    if program.speculative is not None:
        state = state.replace(speculation=speculation_state(program, tables, prompts, buffer_len))
    return layout.state(state)


def first_capture(program: Program, states: jax.Array, buffer_len: int) -> tuple:
    """The state's `capture` after a prefill whose captured `states` are [B, P, C, E]: the
    prompt's (with `capture_prompt`), and the generated buffer with column 0, the states
    that drew the first token (the prompt's last column), filled."""
    batch, _, layers_, width = states.shape
    generated = jnp.zeros((batch, buffer_len, layers_, width), jnp.float32)
    generated = generated.at[:, 0].set(states[:, -1].astype(jnp.float32))
    prompt = states.astype(jnp.float32) if program.capture_prompt else None
    return prompt, generated


def speculation_state(
    program: Program, tables: Tables, prompts: PromptBatch, buffer_len: int
) -> Any:
    """Speculation's per-row state after a prefill of `prompts` (`speculative.init`). A
    draft model's cache is its own (contiguous, `cache_len` slots a row): its prefill takes
    each whole prompt, also where the target's prefill computed only the columns after
    shared pages (`host.suffix_batch`)."""
    prompt, positions = prompts.prompt, prompts.positions
    width = prompts.cache_len - buffer_len
    if prompt.shape[1] != width:
        prompt, positions = prompts.whole(width)
    return program.speculative.init(
        tables.draft_weights, prompt, positions, prompts.cache_len, program.layout
    )


def last_tokens(state: DecodeState) -> jax.Array:
    """[B] i32: each row's last generated token (0 before the first, or when none)."""
    idx = jnp.maximum(state.num_tokens - 1, 0)[:, None]
    return jnp.maximum(jnp.take_along_axis(state.tokens, idx, axis=1)[:, 0], 0)


def decode_step(program: Program, tables: Tables, s: DecodeState) -> DecodeState:
    """One token per running row: feed its last token, sample, record.

    With a paged pool (`s.pages`), the running rows first grow by a page where they need
    one; a row refused one (or parked) feeds and draws nothing, and the rows that finish
    return their pages (`pool`)."""
    if s.pages is None:
        live, cache = ~s.done, s.cache
    else:
        s, live = paged.grow(s, program.pool)
        if tables.guidance is not None:  # a guided row and its negative row step together
            s, live = guidance.together(tables.guidance, s, live)
        cache = paged.attach(s.cache, paged.layer_tables(s.pages, program.pool))
    # Finished rows feed a padding position, so their cache is never written again.
    pos = jnp.where(live, s.prompt_len + s.num_tokens - 1, -1)[:, None]
    runner = program.runner
    if s.routing is None:
        logits, cache, *got = runner.forward(
            tables.weights, last_tokens(s)[:, None], pos, cache, mesh=program.layout.row_mesh,
            rows=tables.rows,
        )  # fmt: skip
        if program.capture:  # the states that draw token num_tokens go to that column
            prompt_states, generated = s.capture
            states = got[0].astype(jnp.float32)  # [B, 1, C, E]
            if program.capture_scatter:  # each running row at its own num_tokens
                col = jnp.where(live, s.num_tokens, generated.shape[1])  # out of range: dropped
                rows = jnp.arange(col.shape[0])
                generated = generated.at[rows, col].set(states[:, 0], mode="drop")
            else:
                # On `generate`'s contiguous cache every running row has drawn one token per
                # step, so its num_tokens is step + 1 (< N while the loop runs): one in-place
                # slice update of that column, the finished rows' kept (a scatter at each
                # row's num_tokens cost 26% of the decode's tokens/s on a CPU).
                old = jax.lax.dynamic_slice_in_dim(generated, s.step + 1, 1, axis=1)
                states = jnp.where(live[:, None, None, None], states, old)
                generated = jax.lax.dynamic_update_slice_in_dim(
                    generated, states, s.step + 1, axis=1
                )
            s = s.replace(capture=(prompt_states, generated))
    else:
        # The fed token is generated token num_tokens - 1: its experts go to that column.
        batch = pos.shape[0]
        logits, cache, used = runner.forward(
            tables.weights, last_tokens(s)[:, None], pos, cache, mesh=program.layout.row_mesh,
            routing=runner.no_routing(tables.weights, batch, 1), rows=tables.rows,
        )  # fmt: skip
        prompt_routing, generated = s.routing
        col = jnp.where(live, s.num_tokens - 1, generated.shape[1])  # out of range: dropped
        generated = generated.at[jnp.arange(batch), col].set(used[:, 0], mode="drop")
        s = s.replace(routing=(prompt_routing, generated))
    if s.pages is None:
        return sample_state(program.layout, tables, logits, s.replace(cache=cache))
    new = sample_state(
        program.layout, tables, logits, s.replace(cache=paged.detach(cache)), where=live
    )
    return paged.release(s, new)


@functools.partial(runner_jit, static_argnames=("program",), donate_argnames=("state",))
def decode(
    program: Program,
    tables: Tables,
    state: DecodeState,
    max_steps: jax.Array,  # [] i32: stop after this many loop iterations in total
) -> DecodeState:
    """Feed each row's last token and sample the next, until every row is done.

    Also stops once `state.step` reaches `max_steps` or every running row's buffer is full, so
    that `stream` and `generate_many` can run the same compiled loop in chunks.

    With `program.speculative` (`logitloop.decoding.loop.speculative`) each iteration is one
    propose-verify-accept cycle (`speculative.cycle`), which records one or more tokens per
    row, after the plain steps it takes while no row proposes (those count as iterations
    too, and neither runs once `max_steps` is reached).
    """
    buf = state.tokens.shape[1]

    def cond(s: DecodeState):
        # Buffer full is judged per row: rows that entered later (generate_many's slots)
        # have room left when the first rows' buffers are full.
        # With a paged pool a row refused a page ends the chunk (the host preempts).
        running = jnp.any(paged.runnable(s) & (s.num_tokens < buf))
        return (s.step < max_steps) & running & ~paged.any_stalled(s)

    def body(s: DecodeState):
        if program.speculative is None:
            s = decode_step(program, tables, s)
            return program.layout.state(s.replace(step=s.step + 1))
        # Plain steps and at most one cycle, each counted in `step`, none once `cond` fails.
        return program.speculative.cycle(program, tables, s, keep_going=cond)

    return jax.lax.while_loop(cond, body, state)
