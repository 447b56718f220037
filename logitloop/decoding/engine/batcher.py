"""Continuous batching: keep a fixed set of rows busy over a long list (or stream) of prompts.

`generate` runs one batch until its slowest row stops, so rows that finish early sit idle.
`generate_many` instead owns `slots` rows of one long-lived `DecodeState` and:

1. prefills waiting requests into free slots (`_admit`: `prefill` from `loop.py` on a
   group of `prefill_batch` prompts, then a scatter of every per-row field of the fresh
   state, the per-slot `SamplingParams` rows and the stop-string rows into the slots);
2. decodes every slot for `chunk_steps` steps with the same `decode` while loop as
   `generate` (finished and empty slots are `done` and stay untouched);
3. copies the rows that stopped to the host, frees their slots, and goes back to 1.

Dispatch is asynchronous, so while the device runs a chunk the host returns the results of
the previous one and reads (tokenizes, validates) the next requests. Empty slots hold greedy
params, so they never send the sampler down its whole-vocabulary paths.

Every shape is fixed up front: the slot count, the prompt bucket `P` and the generation
buffer `N` (from `max_prompt_len` / `max_tokens`), hence the cache (`P + N` slots per row),
and the widths of the per-row lists in the params (`checks.Widths`: bias, banned, allowed
and stop ids, stop sequences, stop strings, top logprobs). A request whose lists outgrow a
width widens it (`SamplingParams.widen`, to the next power of two as `create` buckets
them) and that shape compiles once; a second job with the same bounds and settings of the
same kind compiles nothing.

Identity with `generate` (whose host helpers check the requests, and whose `collect` takes
the finished rows): a slot's new request starts from a fresh state row (tokens -1,
counters 0, a zeroed cache row, its own history, stop windows and params), its prompt sits
at positions `0 .. len - 1` and its generated token `i` is drawn with the random stream
`(seed, i)` and fed back at position `len + i`, exactly as `generate` does for that prompt
alone. So each request's tokens are those of `ll.generate(model, [prompt], params)` with
the same settings (the model sees other shapes: identical for exact arithmetic, and up to
float rounding of the attention reductions otherwise).

Results are `GenerationResult`s with one prompt each (`n` rows when `n > 1`), in input order
from `generate_many`, in completion order from `iter_generate_many`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import job_adapters, job_capture, job_guidance, job_steering
from logitloop.decoding.engine.host import (
    MIN_BUFFER_BUCKET,
    MIN_PROMPT_BUCKET,
    GenerationResult,
    bucket,
    collect,
    constraint_vocabulary,
    prompt_batch,
    stop_tables,
    suffix_batch,
    tokenize_prompt,
)
from logitloop.decoding.engine.job_requests import (
    _describe,
    _Pending,
    _Row,
    _split_request,
)
from logitloop.decoding.engine.plan import Plan
from logitloop.decoding.loop import pool, stop_strings
from logitloop.decoding.loop import speculative as speculation
from logitloop.decoding.loop.decode_loop import (
    DecodeState,
    Outputs,
    Program,
    PromptBatch,
    Tables,
    decode,
    prefill,
)
from logitloop.decoding.loop.runner import runner_jit
from logitloop.decoding.loop.stop_strings import StopStrings
from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling import processors as procs
from logitloop.decoding.sampling.checks import MIN_LIST_WIDTH, Widths
from logitloop.decoding.sampling.constraints import HostAutomaton
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import (
    SamplingParams,
    canonical_knobs,
)

# --------------------------------------------------------------------------- device side


@functools.partial(
    jax.jit,
    static_argnames=(
        "program", "vocab", "batch", "prompt_len", "buffer_len", "num_top", "window", "text",
        "capture",
    ),
)  # fmt: skip
def _empty_state(
    program: Program,
    tables: Tables,
    *,
    vocab: int,
    batch: int,
    prompt_len: int,
    buffer_len: int,
    num_top: int,
    window: int,
    text: int,
    capture: tuple[int, int] | None = None,
) -> DecodeState:
    """A state whose every row is an empty, finished slot (the loop never touches it);
    `capture`: the captured states' (C, E), with `program.capture` (`job_capture`)."""
    cap = prompt_len + buffer_len
    zeros = jnp.zeros((batch,), jnp.int32)
    pages = None
    if program.pool is None:
        cache = program.runner.init_cache(tables.weights, batch, cap)
    else:  # one paged pool shared by the slots (`kv_cache_tokens`)
        cache, pages = pool.init(program.runner, tables.weights, program.pool, batch)
    state = DecodeState.empty(
        cache=cache,
        history=History(jnp.full((batch, cap), -1, jnp.int32), zeros, zeros),
        prompt_len=zeros,
        buffer_len=buffer_len,
        num_top=num_top,
        window=window,
        text=text,
        processor_states=procs.init_states(tables.params.processors, batch, vocab),
        done=True,
    ).replace(pages=pages)
    state = state.replace(capture=job_capture.empty(program, capture, state))
    if program.speculative is not None:  # a one-column "prompt" of padding: nothing is written
        pad = jnp.full((batch, 1), -1, jnp.int32)
        spec = program.speculative.init(
            tables.draft_weights, jnp.maximum(pad, 0), pad, cap, program.layout
        )
        state = state.replace(speculation=spec)
    return program.layout.state(state)


@functools.partial(
    runner_jit,
    static_argnames=("program", "buffer_len", "num_top"),
    donate_argnames=("state",),
)
def _admit(
    program: Program,
    tables: Tables,  # [S slots]
    state: DecodeState,  # [S]
    slot: jax.Array,  # [G] i32, the slot of each new row; S (out of range) = dummy row
    prompts: PromptBatch,  # [G] new rows
    new: Tables,  # [G] the new rows' params and stop strings (no weights, no automata)
    fsm: jax.Array,  # [G] i32, the new rows' initial automaton states
    prefix: Any = None,  # with a pool: (pages [G, P], count [G]), cached prompt pages shared
    *,
    buffer_len: int,
    num_top: int,
) -> tuple[DecodeState, SamplingParams, Any]:
    """Prefill G prompts and write their fresh rows (state, params, stop strings, automaton
    states) into slots; returns the state and the slots' params and stop-string tables.
    With `prefix`, `prompts` holds only the columns after each row's shared pages
    (`suffix_batch`): the prefill computes those and attends the rest."""
    rows = tables.replace(params=new.params, stops=new.stops, guidance=new.guidance)
    if new.rows is not None:  # the new rows' adapters (over the job's table) and vectors
        rows = rows.replace(
            rows=tables.rows.replace(adapter=new.rows.adapter, steer=new.rows.steer)
        )
    if new.draft_weights is not None:  # a draft's own adapters: the new rows' (draft_inputs)
        rows = rows.replace(draft_weights=new.draft_weights)
    cache = None
    if state.pages is not None:  # the new rows' prefill writes into the shared pool
        state, cache = pool.admit(state, slot, prompts.lengths, prefix, shape=program.pool)
    fresh = prefill(program, rows, prompts, fsm, cache, buffer_len=buffer_len, num_top=num_top)

    def put(big, small):
        if big.ndim == 0:  # the loop's step counter is shared, not per row
            return big
        return big.at[slot].set(small.astype(big.dtype), mode="drop")

    if state.pages is None:
        state = program.layout.state(jax.tree.map(put, state, fresh))
    else:
        state = program.layout.state(pool.admitted(state, fresh, put))
    stops = tables.stops
    if stops is not None:
        stops = stops.replace(
            strings=put(stops.strings, new.stops.strings),
            lengths=put(stops.lengths, new.stops.lengths),
        )
    # The slots' params and stop strings only: returning the tables would write a copy of
    # every weight into a new output buffer at each admission.
    return state, jax.tree.map(put, tables.params, new.params), stops


# --------------------------------------------------------------------------- host side


class _Batcher:
    """The slot state and the scheduling loop behind `iter_generate_many`."""

    def __init__(
        self,
        plan: Plan,
        *,
        slots: int,
        max_prompt_len: int,
        max_tokens: int,
        chunk_steps: int,
        prefill_batch: int,
        defaults: Mapping[str, Any],
    ):
        self.plan = plan
        self.info = plan.info
        self.n = plan.options.n
        self.slots = slots
        self.max_prompt_len = max_prompt_len
        self.max_tokens = max_tokens
        self.prompt_len = bucket(max_prompt_len, MIN_PROMPT_BUCKET)
        self.buffer_len = bucket(max_tokens, MIN_BUFFER_BUCKET)
        self.chunk_steps = chunk_steps
        self.group = prefill_batch
        self.defaults = dict(defaults)
        # Blocks of slots a row is admitted to by itself (`_Row.shard`): a mesh's data shards
        # when they hold separate pools (`paged_batching`); 1 here.
        self.shards = 1
        self.structure = None  # the processors' tree structure, fixed by the first request
        # Room for a few stop sequences from the start, and stop-string tables whenever the
        # model has a tokenizer (as `generate`'s), so most jobs never widen them.
        self.widths = Widths(
            sequences=MIN_LIST_WIDTH,
            sequence_len=MIN_LIST_WIDTH,
            stop_strings=MIN_LIST_WIDTH if self.info.tokenizer is not None else 0,
        )
        self.state: DecodeState | None = None
        # What the loop reads for the slots: params [S] at self.widths, the stop-string
        # tables (None while no slot had one) and the automata seen so far.
        self.tables: Tables | None = None
        self.slot_stops: list[tuple[str, ...]] = [()] * slots  # each slot's stop strings
        # The constraints' automata seen so far, packed in this order (appended only, so a
        # running row's state stays valid when the tables grow).
        self.automata_seen: list[HostAutomaton] = []
        self.initial: dict[int, int] = {}  # id(automaton) -> its initial state in the tables
        self.adapters = job_adapters.for_job(plan.options, slots)  # LoRA, or None
        self.steering: job_steering.JobSteering | None = None  # set by `run`, or None
        self.capture = job_capture.for_job(plan, slots, self.prompt_len, self.buffer_len)
        self.guidance: job_guidance.JobGuidance | None = None  # from the first guided request

    # ------------------------------------------------------------------ requests

    def prepare(self, index: int, item: Any) -> tuple[_Pending, list[_Row]]:
        """Tokenize and validate one request; returns its record and its `n` rows.

        One request at a time (`SamplingParams.create` of batch 1): the shapes of the small
        host-side arrays then depend only on the request's own settings, so a second job
        with settings of the same kinds compiles nothing at all.
        """
        request = _split_request(item)
        prompt, knobs = request.prompt, request.params
        plan = self.plan
        if request.processors is not None:
            options = dataclasses.replace(plan.options, processors=request.processors)
            plan = dataclasses.replace(plan, options=options)
        try:
            if isinstance(knobs, SamplingParams):
                params = knobs
                if params.batch_size != 1:
                    raise ValueError(
                        f"params has batch_size {params.batch_size}; a request needs batch_size 1"
                    )
            elif knobs is None or isinstance(knobs, Mapping):
                params = SamplingParams.create(
                    1, **{**self.defaults, **canonical_knobs(knobs or {})}
                )
            else:
                raise ValueError(f"params must be a dict or a SamplingParams, got {knobs!r}")
            name = "the prompt"
            ids = [tokenize_prompt(name, prompt, self.info)]
            if len(ids[0]) > self.max_prompt_len:
                raise ValueError(
                    f"{name} has {len(ids[0])} tokens, over max_prompt_len = {self.max_prompt_len}"
                )
            ids, params = plan.rows(None, params, ids=ids, names=[name])
            structure = jax.tree.structure(params.processors)
            if self.structure is None:
                self.structure = structure
            elif structure != self.structure:
                raise ValueError(
                    f"its processors have the tree structure {structure}, but the job's "
                    f"first request's have {self.structure}: every request of a job needs "
                    "processors of the same structure"
                )
            most = int(np.asarray(params.max_tokens)[0])
            if most > self.max_tokens:
                raise ValueError(
                    f"max_tokens = {most} is over the job's max_tokens_bound = "
                    f"{self.max_tokens} (pass a larger max_tokens_bound=)"
                )
            if any(params.stop) and self.info.tokenizer is None:
                raise ValueError("stop strings need a model that carries a tokenizer")
            compiled = [None] * self.n
            if params.constraints:
                vocab = constraint_vocabulary(self.info)
                compiled = constraints.compile_rows(params.constraints, vocab)
                stop_ids = np.asarray(params.stop_token_ids)
                constraints.refuse_stop_ids(params.constraints, stop_ids, vocab)
            self.steering, steer = job_steering.resolve(
                self.steering, self.plan, self.slots, request.steer, len(ids[0])
            )
            adapter = job_adapters.slot_of(self.adapters, request.adapter, self.n)  # last
            widths, model_rows = params.widths(), dict(adapter=adapter, steer=steer)
            rows = [
                _Row(index, c, ids[c], params.take([c]), widths, compiled[c], **model_rows)
                for c in range(self.n)
            ]
            rows = job_guidance.rows(self, request, ids[0], params, rows)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{_describe(index, request.id)}: {e}") from None
        except NotImplementedError as e:
            raise NotImplementedError(f"{_describe(index, request.id)}: {e}") from None
        if len(rows) > self.n and self.guidance is None:  # the job's first guided request
            self.guidance = job_guidance.JobGuidance(self.slots)
        none = [None] * self.n
        pending = _Pending(index, ids, params, list(none), list(none), list(none))
        return pending, rows

    # ------------------------------------------------------------------ device state

    def _tables(self, stop: Sequence[tuple[str, ...]]) -> StopStrings | None:
        """Stop-string tables for rows `stop` at the job's widths (None while none has one)."""
        return stop_tables(self.info, stop, self.widths)

    def _resize(self, widths: Widths, template: SamplingParams) -> None:
        """Start the slot state, or widen its per-row lists (a new shape: compiles once).

        `template`: one row whose params (and processors) fill the empty slots, greedy."""
        old, self.widths = self.widths, widths
        stops = self._tables(self.slot_stops)
        text = 0 if stops is None else stops.window
        if self.state is None:
            # Empty slots are greedy: no row of theirs takes the sampler's slow paths.
            empty = template.widen(widths).take([0] * self.slots)
            empty = empty.replace(temperature=jax.device_put(np.zeros(self.slots, np.float32)))
            layout = self.plan.layout
            rows = job_steering.slot_rows(self.adapters, self.steering, layout, self.capture)
            names = job_adapters.names(self.adapters)
            self.tables = self.plan.tables(empty, stops, rows=rows, names=names)
            self.state = _empty_state(
                self.plan.program,
                self.tables,
                vocab=self.info.vocab_size,
                batch=self.slots,
                prompt_len=self.prompt_len,
                buffer_len=self.buffer_len,
                num_top=widths.top_logprobs,
                window=widths.sequence_len,
                text=text,
                capture=None if self.capture is None else self.capture.shape,
            )
            return
        self.tables = self.tables.replace(params=self.tables.params.widen(widths), stops=stops)
        s = self.state

        def pad_left(arr: jax.Array, width: int, fill: int) -> np.ndarray:
            arr = np.asarray(arr)
            return np.pad(arr, ((0, 0), (width - arr.shape[1], 0)), constant_values=fill)

        top_ids, top_values = s.top_ids, s.top_values
        if widths.top_logprobs > old.top_logprobs:
            # Wider for the new request; the rows in flight keep theirs (padding at the right).
            more = ((0, 0), (0, 0), (0, widths.top_logprobs - old.top_logprobs))
            top_ids = np.pad(np.asarray(top_ids), more, constant_values=-1)
            top_values = np.pad(np.asarray(top_values), more, constant_values=-np.inf)
        # Windows keep their newest entries at the right: older ones only pad the left.
        # (Host arrays: the next call moves them; nothing compiles here.)
        self.state = s.replace(
            window=pad_left(s.window, widths.sequence_len, -1),
            text_window=pad_left(s.text_window, text, stop_strings.SENTINEL),
            top_ids=top_ids,
            top_values=top_values,
        )

    def _add_automata(self, rows: Sequence[_Row]) -> None:
        """Append the rows' new automata to the job's tables (never shrinking a bucket)."""
        new = [r.automaton for r in rows if r.automaton is not None]
        new = [a for a in dict.fromkeys(new) if id(a) not in self.initial]
        if not new:
            return
        self.automata_seen += new
        old = self.tables.automata
        grow = (
            {}
            if old is None
            else {"min_states": old.bits.shape[0], "min_edges": old.targets.shape[0]}
        )
        automata, initial = constraints.pack(self.automata_seen, **grow)
        self.tables = self.tables.replace(automata=automata)
        self.initial = {id(a): s for a, s in zip(self.automata_seen, initial, strict=True)}

    def admit(self, rows: Sequence[_Row], free: list[int]) -> list[int]:
        """Prefill `rows` into slots taken from `free`; returns the slots used."""
        need = self.widths
        for row in rows:
            need = need.union(row.widths)
        if self.state is None or need != self.widths:
            self._resize(need, rows[0].params)
        self._add_automata(rows)
        used = {}
        for group in self.groups(rows):
            placed, slot = self.place(group, free)
            for row, where in zip(placed, slot, strict=True):
                if row is not None:
                    used[id(row)] = int(where)
                    self.slot_stops[where] = row.params.stop[0] if row.params.stop else ()
            self.admit_group(placed, slot)
        return [used[id(row)] for row in rows]

    def full(self, group: Sequence[_Row], unit: Sequence[_Row]) -> bool:
        """Whether `group` has no places left for `unit` (a row, or a guided row and its
        negative row, `job_guidance.units`): `prefill_batch / shards` places per block of
        slots (`place`)."""
        taken = sum(r.shard == unit[0].shard for r in group)
        return taken + len(unit) > self.group // self.shards

    def place(self, group: Sequence[_Row], free: list[int]) -> tuple[list, np.ndarray]:
        """The prefill batch of `group`: `[prefill_batch]` places, None for a dummy, and
        the slot of each (taken from `free`; S, out of range, for a dummy). Block i of the
        places (rows of one data shard) takes rows and slots of block i of the slots."""
        per, block = self.group // self.shards, self.slots // self.shards
        placed: list[_Row | None] = [None] * self.group
        slot = np.full((self.group,), self.slots, np.int32)  # dummies: dropped
        filled = [0] * self.shards
        for row in group:
            i = row.shard * per + filled[row.shard]
            filled[row.shard] += 1
            placed[i] = row
            slot[i] = next(s for s in free if s // block == row.shard)
            free.remove(slot[i])
        return placed, slot

    def groups(self, rows: Sequence[_Row]) -> Iterator[list[_Row]]:
        """The rows in prefill groups that `place` can hold (a prefix cache's batcher also
        starts a new group where a row reuses pages a row before it writes)."""
        group: list[_Row] = []
        for unit in job_guidance.units(rows):
            if self.full(group, unit):
                yield group
                group = []
            group += unit
        if group:
            yield group

    def admit_group(
        self, group: list[_Row | None], slot: np.ndarray, shared: np.ndarray | None = None
    ) -> None:
        """Prefill one group of rows into `slot` ([prefill_batch], dummies out of range;
        `group`: `place`'s rows, None for a dummy, which repeats the first row).
        `shared` ([prefill_batch, P] int32, -1 past each row's pages): with a paged pool,
        cached full pages of each row's prompt it reads instead of prefilling them."""
        guidance = job_guidance.admitted(self.guidance, group, slot)  # [G], and the slots'
        first = next(row for row in group if row is not None)
        group = [first if row is None else row for row in group]
        group = group + [first] * (self.group - len(group))
        batch = prompt_batch([row.ids for row in group], self.buffer_len, self.prompt_len)
        prefix = None
        if shared is not None:
            count = np.sum(shared >= 0, axis=1).astype(np.int32)
            batch = suffix_batch(batch, count * self.plan.program.pool.page_size)
            prefix = (shared, count)
        new_params = SamplingParams.concat([row.params for row in group], self.widths)
        new_stops = None
        if self.tables.stops is not None:
            new_stops = self._tables(new_params.stop or [()] * len(group))
        fsm = np.asarray(
            [-1 if r.automaton is None else self.initial[id(r.automaton)] for r in group],
            np.int32,
        )
        layout = self.plan.layout
        rows = job_steering.admitted(self.adapters, self.steering, slot, group, layout)
        self.tables, new_draft = job_steering.refreshed(
            self.plan, self.tables, rows, self.adapters, self.steering, self.capture
        )
        if self.guidance is not None:
            self.tables = self.tables.replace(guidance=self.guidance.tables())
        new = Tables(
            None, new_params.device_only(), new_stops, draft_weights=new_draft, rows=rows,
            guidance=guidance,
        )  # fmt: skip
        self.state, params, stops = _admit(
            self.plan.program,
            self.tables,
            self.state,
            slot,
            batch,
            new,
            fsm,
            prefix,
            buffer_len=self.buffer_len,
            num_top=self.widths.top_logprobs,
        )
        self.tables = self.tables.replace(params=params, stops=stops)

    def admissible(self, waiting: Sequence[_Row], free: list[int], occupant: dict) -> int:
        """How many of the `waiting` rows to admit into the `free` slots now (with a paged
        pool, `paged_batching`: as many as its free pages hold, each to a shard)."""
        return job_guidance.whole(waiting, min(len(waiting), len(free)))

    def resume(self, occupant: dict) -> None:
        """Resume preempted rows (a paged pool's, `paged_batching`); nothing here."""

    def dispatch(self) -> None:
        """Start one chunk of decode steps (asynchronously: the host carries on)."""
        state = self.state.replace(step=np.int32(0))
        self.state = decode(self.plan.program, self.tables, state, np.int32(self.chunk_steps))

    def done(self, occupant: dict) -> np.ndarray:
        """Wait for the chunk; the host copy of every slot's `done` (`occupant`: the slots'
        rows, which a paged pool's preemption reads)."""
        return np.asarray(jax.device_get(self.plan.layout.host_view(self.state.done)))

    def fetch(self, slots: Sequence[int]) -> list[tuple[Outputs, Any, Any]]:
        """Copy the finished rows in `slots` to the host, each as `Outputs` of one row, its
        speculation counts (None without `speculative=`) and its captured states
        (`job_capture.JobCapture.fetch`; None without `capture=`)."""
        outputs = jax.device_get(self.plan.layout.host_view(self.state.outputs()))
        counts = speculation.stats(self.state.speculation, self.slots)
        states = self.capture.fetch(self.state, slots) if self.capture else [None] * len(slots)
        return [
            (outputs.take([slot]), counts and counts[slot], got)
            for slot, got in zip(slots, states, strict=True)
        ]

    # ------------------------------------------------------------------ results

    def result(self, pending: _Pending) -> GenerationResult:
        """The request's rows as `generate` would return them for that prompt alone."""
        # The slots may keep top logprobs for the job's other requests: keep this one's. Its
        # own `logprobs`, not its params' static width: a job may have widened the params to
        # the batch's widest row (a mesh's batches do).
        k = int(np.max(np.asarray(pending.params.logprobs), initial=0))
        outputs = Outputs.concat(
            [
                o.replace(top_ids=o.top_ids[:, :, :k], top_values=o.top_values[:, :, :k])
                for o in pending.outputs
            ]
        )
        result = collect(outputs, pending.ids, pending.params, self.info)
        if self.plan.program.speculative is not None:
            result.speculation = list(pending.speculation)
        if self.capture is not None:
            result.captured = self.capture.rows(pending.captured, pending.ids, result.num_tokens)
        return result.per_request()

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Iterable[Any]) -> Iterator[tuple[int, GenerationResult]]:
        """Admit, decode a chunk, collect; host work overlaps the device's chunk.

        While a chunk runs on the device, the host yields the results of the previous
        chunk and reads (tokenizes, validates) up to `prefill_batch` requests ahead.
        """
        self.steering = job_steering.for_job(self.plan, self.slots, requests, _describe)
        source = enumerate(requests)
        exhausted = False
        waiting: deque[_Row] = deque()
        pending: dict[int, _Pending] = {}
        free = list(range(self.slots))
        occupant: dict[int, _Row] = {}
        ready: list[int] = []  # complete requests, yielded while the next chunk runs

        def read(rows: int) -> None:
            nonlocal exhausted
            while not exhausted and len(waiting) < rows:
                try:
                    index, item = next(source)
                except StopIteration:
                    exhausted = True
                    return
                request, new = self.prepare(index, item)
                pending[index] = request
                waiting.extend(new)

        while True:
            read(len(free))
            self.resume(occupant)
            if waiting and free:
                count = self.admissible(waiting, free, occupant)
                take = [waiting.popleft() for _ in range(count)]
                for slot, row in zip(self.admit(take, free) if take else [], take, strict=True):
                    occupant[slot] = row
            if occupant:
                self.dispatch()
            for index in ready:
                yield index, self.result(pending.pop(index))
            ready = []
            if not occupant:
                return
            read(self.group)
            done = self.done(occupant)
            finished = sorted(slot for slot in occupant if done[slot])
            if not finished:
                continue
            rows = {slot: occupant.pop(slot) for slot in finished}
            for slot, row in rows.items():
                free.append(slot)
                if self.guidance is not None:
                    self.guidance.freed(slot)
                if not row.negative:  # a negative row runs under its row's hold
                    job_adapters.finished(self.adapters, row.adapter)
            real = [slot for slot in finished if not rows[slot].negative]  # negatives: dropped
            for slot, (out, counts, states) in zip(real, self.fetch(real), strict=True):
                row = rows[slot]
                request = pending[row.request]
                request.outputs[row.child] = out
                request.speculation[row.child] = counts
                request.captured[row.child] = states
                if all(o is not None for o in request.outputs):
                    ready.append(row.request)
            free.sort()
            ready.sort()
