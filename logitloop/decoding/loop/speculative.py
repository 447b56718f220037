"""Speculative decoding inside the decode loop: propose, verify in one forward pass, accept.

`decode` (`logitloop.decoding.loop.decode_loop`) runs `cycle` as its `while_loop` body when given a
`PromptLookup` or a `DraftModel`. One cycle, for every running row at once:

1. propose up to K draft tokens d1..dK (`num` of them valid per row): copied from the row's
   own prompt and output after its latest earlier occurrence of its last n tokens
   (`PromptLookup`, longest n first), or drawn by a smaller model with its own KV cache
   (`DraftModel`);
2. one forward pass of the target over the K + 1 columns [last, d1..dK] at positions
   p .. p + K (p = prompt_len + num_tokens - 1, where `last` is fed in a plain step);
3. for j = 0..K (a `while_loop` that ends once no row accepts): the row's full sampling
   step on column j's logits with the history, processor states, stop state and position
   as they are after the tokens accepted so far (`sample_step` through `layout.sample`,
   then `record` with a `where` mask: the loop's own pieces), and the row goes on
   accepting while the token taken at column j equals draft j + 1. (Sampling all K + 1
   columns in one call of B * (K + 1) rows, each with the drafts before it in its history,
   was measured no faster with strict acceptance and slower with rejection on CPU.)

Index bookkeeping, one row, prompt length 3, two tokens t0 t1 generated (num_tokens = 2):
p = 3 + 2 - 1 = 4, the columns [t1, d1, d2, d3] go in at positions 4..7 and their logits
draw the tokens at generated indices 2..5 (random streams (seed, 2)..(seed, 5), as in plain
decoding). Say the row takes d1 at column 0 and, at column 1, a token x != d2: it records
d1, x (num_tokens = 4) and the next cycle feeds x at position 3 + 4 - 1 = 6. Cache slots 4
and 5 (t1, d1) are right; slots 6 and 7 hold the rejected d2, d3 and are rewritten by the
next cycle before any query can see them (a query at position q sees slots <= q). So the
cache "rolls back" by keeping `num_tokens` at the accepted length; a sliding-window ring
ignores entries at or past a call's first position (`models.layers`), so K is capped at
`layers.RING_SLACK`.

Every cycle records at least one token per running row (column 0 is never a draft), and a
row stops at the first accepted token that meets one of its stop conditions.

Acceptance:

- "strict": the token taken at column j is the one the row draws there with its own noise,
  keyed by (seed, position) as always. The output is `generate`'s without speculation,
  token for token, up to the rounding of the wider verify pass (a K + 1 column forward
  sums in another order than a one column one).
- "rejection": standard speculative sampling. A draft d with draft probability q(d) is
  accepted with probability min(1, p(d) / q(d)) under the row's final distribution p
  (after every step of the sampling order), with a uniform from a sub-stream of the row's
  own key at that position; on rejection the token is drawn from max(p - q, 0)
  renormalised, with another (`sampler.rejection_choice`). Prompt-lookup drafts have q
  one-hot. The tokens then follow the same distribution as plain sampling, though not the
  same tokens.

Greedy rows (temperature 0 or top_k 1) have p one-hot, where both modes coincide.

Switching off, per row and per batch. A row whose drafts are rarely accepted stops
proposing: a moving average of the accepted fraction of its drafts (weight `EMA` for the
latest cycle) starts at 0.5, and below `min_acceptance` (default 0.25: two cycles without a
hit) the row is off. A cycle also has a price: it costs the whole batch `cycle_cost` plain
steps (the wide forward, a draft model's K steps, up to K + 1 sampling steps), and a batch
ends with its slowest row, so a cycle pays only if every running row gains more than that.
Each row keeps a moving average of the tokens its cycles with drafts brought (`gain`,
starting at 1 + K / 2); a row that is off, or has no draft now (`ready`: prompt lookup
finds no earlier occurrence), counts 1, and a cycle runs only while the smallest over the
running rows is at least `cycle_cost`: with S cycles and P plain steps the slowest row's N
tokens take about S * g_min + P = N, so time N + S * (cycle_cost - g_min) in plain steps.
`cycle_cost=None` takes `default_cycle_cost`: measured on XLA:CPU, 1.0 elsewhere (the
memory-bound case, where the K + 1 columns read the weights once: the gate never closes
and only the per-row switch acts). Every `probe_every`-th step (not the first) is a probe:
every running row proposes, whatever its averages. A probe that does not pay costs the
batch at most `cycle_cost - 1` steps, so `probe_every=None` spaces probes to keep that
under `PROBE_SHARE` of the time, and at least 32 steps apart (`default_probe_every`).
While no cycle runs, the loop takes plain one-column steps (`loop.decode_step`), which
count as cycles; a draft model skips them and is fed what it missed before it next
proposes. Steps and cycles both count against `decode`'s `max_steps`, and none starts once
it is reached.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.loop import decode_loop as loop
from logitloop.decoding.loop import pool as paged
from logitloop.decoding.loop.layout import Layout
from logitloop.decoding.loop.runner import ModelRunner, model_info
from logitloop.decoding.sampling import sampler
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.kv import Rows
from logitloop.models.layers import RING_SLACK
from logitloop.ops.sampling import noise

ACCEPTANCE = ("strict", "rejection")
DRAFT_STREAM = 3  # a row's sub-stream for a draft model's sampled drafts (`sampler.sub_key`)
EMA = 0.3  # weight of the latest cycle in a row's acceptance average
START_ACCEPTANCE = 0.5  # the average a row starts with
CATCH_UP = 8  # columns per call feeding a draft model the tokens it missed while off
PROBE_SHARE = 0.05  # at most this share of the steps lost to probes that do not pay
# What a cycle with num_draft = 4 costs on XLA:CPU, in plain decode steps, by (kind,
# acceptance): the shipped model at T = 0 (about 2.6 tokens a cycle), the mean of batch 1
# and 8 (BENCHMARKS.md, 2026-12-03 (evening), `scripts/bench_speculative.py --cycle-cost`:
# 2.13/2.71, 2.96/3.27, 2.50/2.99, 3.69/4.43). `default_cycle_cost` scales the part above
# one step with K.
CPU_CYCLE_COST = {
    ("lookup", "strict"): 2.4,
    ("lookup", "rejection"): 3.1,
    ("draft", "strict"): 2.75,
    ("draft", "rejection"): 4.05,
}


@struct.dataclass
class SpecState:
    """Per-row speculation bookkeeping carried in `DecodeState.speculation`."""

    acceptance: jax.Array  # [B] f32, moving average of the accepted fraction of drafts
    gain: jax.Array  # [B] f32, moving average of the tokens a cycle with drafts brought
    cycles: jax.Array  # [B] i32, cycles the row ran in (plain steps included)
    proposed: jax.Array  # [B] i32, cycles in which the row's drafts were verified
    drafted: jax.Array  # [B] i32, draft tokens verified
    accepted: jax.Array  # [B] i32, draft tokens accepted
    # [B] i32: positions below this hold the right keys/values in a DraftModel's cache (the
    # draft is fed what it missed before it proposes: `_Draft.catch_up`); unused otherwise
    fed: jax.Array | None = None
    draft_cache: Any = None  # a DraftModel's KV cache


def _check(obj: Any, field: str, lo: float, hi: float, kind=int) -> None:
    """`obj.field` checked, an int (or with `kind=float` a number; NumPy's too, as every
    other argument takes them) in [lo, hi], and stored as a Python `kind`."""
    name, value = f"{type(obj).__name__}.{field}", getattr(obj, field)
    allowed = (int, np.integer) if kind is int else (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, allowed):
        raise ValueError(
            f"{name} must be {'a number' if kind is float else 'an int'}, got {value!r}"
        )
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value!r} is outside the allowed range [{lo}, {hi}]")
    object.__setattr__(obj, field, kind(value))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Speculation:
    """What both kinds of speculation share: K, the acceptance rule, the switch-off."""

    num_draft: int = 4
    acceptance: str = "strict"
    min_acceptance: float = 0.25
    probe_every: int | None = None  # None: `default_probe_every` (`resolve` fills it in)
    cycle_cost: float | None = None  # None: `default_cycle_cost` (`resolve` fills it in)

    def __post_init__(self):
        name = type(self).__name__
        _check(self, "num_draft", 1, RING_SLACK)
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(
                f"{name}.acceptance = {self.acceptance!r} is not one of {', '.join(ACCEPTANCE)}"
            )
        _check(self, "min_acceptance", 0.0, 1.0, float)
        if self.probe_every is not None:
            _check(self, "probe_every", 1, 2**20)
        if self.cycle_cost is not None:
            _check(self, "cycle_cost", 1.0, self.num_draft + 1.0, float)

    def probe(self, s: loop.DecodeState) -> jax.Array:
        """Whether this cycle is a probe (every `probe_every`-th step but the first): all
        running rows propose."""
        return (s.step > 0) & (s.step % self.probe_every == 0)

    # ------------------------------------------------------------------ the device side

    def init(self, draft_weights, prompt, positions, cache_len: int, layout: Layout) -> SpecState:
        """Per-row state after prefill (`loop.prefill`)."""
        batch = prompt.shape[0]
        zeros = jnp.zeros((batch,), jnp.int32)
        return SpecState(
            acceptance=jnp.full((batch,), START_ACCEPTANCE, jnp.float32),
            gain=jnp.full((batch,), 1 + START_ACCEPTANCE * self.num_draft, jnp.float32),
            cycles=zeros,
            proposed=zeros,
            drafted=zeros,
            accepted=zeros,
            fed=(jnp.max(positions, axis=1) + 1).astype(jnp.int32),
            draft_cache=self.draft_prefill(draft_weights, prompt, positions, cache_len, layout),
        )

    def draft_prefill(self, draft_weights, prompt, positions, cache_len, layout):
        return None

    def ready(self, s: loop.DecodeState) -> jax.Array:
        """[B] bool: the rows that would have drafts now (a draft model: every running row)."""
        return ~s.done

    def propose(self, draft_weights, s: loop.DecodeState, params: SamplingParams, on):
        """-> drafts [B, K] i32, num [B] i32 valid drafts, q [B, K, V] f32 or None (one-hot),
        the new draft cache."""
        raise NotImplementedError

    def cycle(
        self, program: loop.Program, tables: loop.Tables, s: loop.DecodeState, keep_going: Any
    ) -> loop.DecodeState:
        """Plain one-column steps while no running row proposes (a `while_loop` under
        `keep_going`, the decode loop's own condition), then one propose-verify-accept cycle
        (the module docstring) if `keep_going` still holds; every step and cycle adds one to
        `s.step`. No `cond` chooses between the two, nor guards the cycle (a `while_loop`
        that runs at most once does): a cond over the state costs XLA:CPU a copy of the KV
        cache at every step."""

        cost = self.cycle_cost
        if cost is None or self.probe_every is None:
            raise ValueError("cycle_cost or probe_every unset: pass it through resolve()")

        def on_rows(s):
            return paged.runnable(s) & (
                (s.speculation.acceptance >= self.min_acceptance) | self.probe(s)
            )

        def pays(s):  # the module docstring: a cycle runs while the slowest row gains enough
            on = on_rows(s) & self.ready(s)
            gain = jnp.where(on, s.speculation.gain, 1.0)
            slowest = jnp.min(jnp.where(paged.runnable(s), gain, jnp.inf))
            return jnp.any(on) & (self.probe(s) | (slowest >= cost))

        def plain(s):
            spec = s.speculation
            spec = spec.replace(cycles=spec.cycles + (~s.done).astype(jnp.int32))
            s = loop.decode_step(program, tables, s)
            return program.layout.state(s.replace(step=s.step + 1, speculation=spec))

        def once(carry):
            s, _ = carry
            s = self.propose_verify(program, tables, s, on_rows(s))
            return program.layout.state(s.replace(step=s.step + 1)), jnp.bool_(False)

        s = jax.lax.while_loop(lambda s: keep_going(s) & ~pays(s), plain, s)
        s, _ = jax.lax.while_loop(lambda c: c[1] & keep_going(c[0]), once, (s, jnp.bool_(True)))
        return s

    def propose_verify(
        self, program: loop.Program, tables: loop.Tables, s: loop.DecodeState, on: jax.Array
    ) -> loop.DecodeState:
        """One propose-verify-accept cycle; `on` [B]: the rows that propose."""
        draft_weights, params = tables.draft_weights, tables.params
        spec = s.speculation
        running = ~s.done
        if spec.draft_cache is None:  # prompt lookup: skip the lookup when no row is on

            def nothing():
                batch = s.num_tokens.shape[0]
                none = jnp.zeros((batch,), jnp.int32)
                return jnp.full((batch, self.num_draft), -1, jnp.int32), none, None, None

            drafts, num, q, draft_cache = jax.lax.cond(
                jnp.any(on), lambda: self.propose(draft_weights, s, params, on), nothing
            )
        else:
            drafts, num, q, draft_cache = self.propose(draft_weights, s, params, on)
        num = jnp.where(on, num, 0)
        new, num = self.verify(program, tables, s, drafts, num, q)
        gained = new.num_tokens - s.num_tokens
        accepted = jnp.where(num > 0, jnp.minimum(jnp.maximum(gained - 1, 0), num), 0)
        rate = accepted / jnp.maximum(num, 1)
        brought = gained.astype(jnp.float32)
        spec = spec.replace(
            acceptance=jnp.where(
                num > 0, (1 - EMA) * spec.acceptance + EMA * rate, spec.acceptance
            ),
            gain=jnp.where(num > 0, (1 - EMA) * spec.gain + EMA * brought, spec.gain),
            cycles=spec.cycles + running.astype(jnp.int32),
            proposed=spec.proposed + (num > 0).astype(jnp.int32),
            drafted=spec.drafted + num,
            accepted=spec.accepted + accepted,
            # A draft model was fed the row's tokens up to its last one and its drafts but
            # the last (`_Draft.propose`); of those, the accepted ones hold.
            fed=jnp.where(
                running,
                s.history.length + jnp.minimum(accepted, self.num_draft - 1),
                spec.fed,
            ),
            draft_cache=draft_cache,
        )
        return new.replace(speculation=spec)

    def verify(self, program, tables, s, drafts, num, q):
        """The target over [last, d1..dK] in one pass, then each column in turn; returns the
        state and `num`, the drafts verified per row.

        With a paged pool (`s.pages`) a running row first grows to its last token's page, as
        a plain step does (refused: it feeds and takes nothing, `pool.grow`), then to its
        drafts' pages; a row refused those verifies no draft this cycle (`pool.grow_drafts`).
        Pages past the tokens a row accepted stay with it: the next cycle rewrites their
        slots (the rollback is `num_tokens`, as without pages). Rows that finish return
        their pages."""
        k = self.num_draft
        col = jnp.arange(k + 1)[None, :]
        base = (s.prompt_len + s.num_tokens - 1)[:, None]
        tokens = jnp.concatenate([loop.last_tokens(s)[:, None], jnp.maximum(drafts, 0)], axis=1)
        before, live, cache = s, ~s.done, s.cache
        if s.pages is not None:
            s, live = paged.grow(s, program.pool)
            s, num = paged.grow_drafts(s, live, num)
            cache = paged.attach(s.cache, paged.layer_tables(s.pages, program.pool))
        num = jnp.where(live, num, 0)
        pos = jnp.where(live[:, None] & (col <= num[:, None]), base + col, -1)  # [B, K+1]
        logits, cache = program.runner.forward_columns(
            tables.weights, tokens, pos, cache, rows=tables.rows
        )  # the rows' adapters verify; a draft model drafts without them
        s = s.replace(cache=cache if s.pages is None else paged.detach(cache))
        # Column K has no draft after it: a -1 that no token equals ends the acceptance.
        drafts = jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1)  # [B, K+1]
        if q is not None:
            q = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))  # [B, K+1, V]

        def more(carry):
            j, _, accepting = carry
            return (j <= k) & jnp.any(accepting)

        def column(carry):
            j, s, accepting = carry
            draft = drafts[:, j]
            choose = None
            if self.acceptance == "rejection":
                choose = _rejection_choice(draft, None if q is None else q[:, j], j < num)
            s = loop.sample_state(
                program.layout, tables, logits[:, j], s, where=accepting, choose=choose
            )
            token = loop.last_tokens(s)  # the token column j drew, where the row took it
            return j + 1, s, accepting & ~s.done & (j < num) & (token == draft)

        _, s, _ = jax.lax.while_loop(more, column, (jnp.int32(0), s, live))
        if s.pages is not None:
            s = paged.release(before, s)
        return s, num


def _rejection_choice(draft, q, valid):
    """The `choose` hook of `sampler.sample_step` for rejection acceptance at one column:
    draft [B] i32, q [B, V] f32 or None (one-hot at the draft), valid [B] bool (rows whose
    column j holds a draft; the others keep the row's own draw)."""
    return lambda probs, drawn, key: sampler.rejection_choice(probs, drawn, key, draft, q, valid)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup(_Speculation):
    """Drafts copied from the row's own prompt and output, no second model.

    The row's last n tokens (n = max_ngram down to min_ngram) are looked up among its earlier
    tokens; the up to `num_draft` tokens after the latest earlier occurrence are the drafts.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        super().__post_init__()
        _check(self, "max_ngram", 1, 64)
        _check(self, "min_ngram", 1, self.max_ngram)

    def ready(self, s):
        """The rows whose lookup finds an earlier occurrence (cheap: no model runs)."""
        return ~s.done & (self.propose(None, s, None, None)[1] > 0)

    def propose(self, draft_weights, s, params, on):
        hist, length = s.history.tokens, s.history.length  # [B, C], [B]
        batch, cap = hist.shape
        k = self.num_draft
        idx = jnp.arange(cap)[None, :]
        end = jnp.full((batch,), -1, jnp.int32)  # end index of the occurrence found
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            suffix = jnp.take_along_axis(
                hist, jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, cap - 1), axis=1
            )  # [B, n]
            match = (idx >= n - 1) & (idx <= length[:, None] - 2)  # a token must follow
            for m in range(n):
                shift = n - 1 - m  # hist[i - shift] must equal suffix[m]
                shifted = jnp.pad(hist, ((0, 0), (shift, 0)), constant_values=-2)[:, :cap]
                match = match & (shifted == suffix[:, m : m + 1])
            latest = jnp.max(jnp.where(match, idx, -1), axis=1)
            end = jnp.where((end < 0) & (length > n), latest, end)
        num = jnp.where(end >= 0, jnp.minimum(k, length - 1 - end), 0).astype(jnp.int32)
        at = jnp.clip(end[:, None] + 1 + jnp.arange(k)[None, :], 0, cap - 1)
        drafts = jnp.take_along_axis(hist, at, axis=1)
        drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, -1)
        return drafts, num, None, None


def resolve(speculative: Any, info: Any, mesh: Any = None) -> tuple[Any, Any]:
    """Host side: `generate`'s `speculative=` argument checked against the target model ->
    (the static speculation `decode` and `prefill` compile against, the draft's weights)."""
    if speculative is not None and mesh is not None:
        raise ValueError("speculative decoding runs on one device: pass mesh=None")
    if speculative is None:
        return None, None
    if isinstance(speculative, PromptLookup):
        spec, draft_weights = speculative, None
    elif isinstance(speculative, DraftModel):
        spec, draft_weights = speculative.resolve(info)
    else:
        raise ValueError(
            "speculative must be None, a logitloop.PromptLookup or a logitloop.DraftModel, "
            f"got {type(speculative).__name__}"
        )
    cost = spec.cycle_cost or default_cycle_cost(spec, jax.default_backend())
    every = spec.probe_every or default_probe_every(cost)
    return dataclasses.replace(spec, cycle_cost=cost, probe_every=every), draft_weights


def default_cycle_cost(spec: _Speculation, platform: str) -> float:
    """What a cycle costs in plain steps when `cycle_cost=None` (the module docstring).

    XLA:CPU is compute-bound at decode: CPU_CYCLE_COST, measured (BENCHMARKS.md). Other
    platforms: 1.0, the memory-bound case the method is built for, not measured here (no
    accelerator was at hand): the gate stays open and rows switch off on acceptance alone."""
    if platform != "cpu":
        return 1.0
    kind = "draft" if isinstance(spec, _Draft) else "lookup"
    extra = CPU_CYCLE_COST[kind, spec.acceptance] - 1.0  # measured at num_draft = 4
    return min(1.0 + extra * spec.num_draft / 4, spec.num_draft + 1.0)


def default_probe_every(cycle_cost: float) -> int:
    """Steps between probes when `probe_every=None`: a probe that brings one token loses
    `cycle_cost - 1` steps, at most `PROBE_SHARE` of the steps between probes; at least 32."""
    return max(32, math.ceil(round((cycle_cost - 1.0) / PROBE_SHARE, 6)))  # 3.15/0.05: 63


def stats(spec: SpecState | None, rows: int) -> list[dict[str, int]] | None:
    """Per row (for `GenerationResult`): cycles (the loop iterations the row ran in, plain
    steps included), proposed (those in which it had drafts verified), drafted and accepted
    draft tokens."""
    if spec is None:
        return None
    keys = ("cycles", "proposed", "drafted", "accepted")
    counts = jax.device_get([getattr(spec, key) for key in keys])
    return [{key: int(c[r]) for key, c in zip(keys, counts, strict=True)} for r in range(rows)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModel(_Speculation):
    """Drafts drawn by a smaller model with the same tokenizer, with its own KV cache.

    strict: the draft proposes its greedy tokens. rejection: it samples at the row's
    temperature (greedy rows: greedy) and its distribution q goes into the acceptance test.
    The draft's cache is kept in step with the target's: each cycle feeds it the row's last
    two tokens (the one before may be missing when every draft was accepted) and then its
    own drafts. Rows switch themselves off as prompt lookup's do; the plain steps taken
    meanwhile skip the draft, which is fed the tokens it missed (`CATCH_UP` columns at a
    time) before it next proposes.

    adapters: the draft's own LoRA adapters (an `ll.Adapters` made for `model`), or None
    (the draft decodes its base weights). A row under the call's adapter "x" drafts under
    the draft's adapter named "x", where this table has one, else under the draft's base
    (drafts change how fast, not what: the target verifies under the row's own adapter).
    Runs where the call takes `adapters=` with a batch fixed at the start (`generate`,
    `stream`, `chat`; `engine.plan.draft_inputs`).
    """

    model: Any = None
    adapters: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.model is None:
            raise ValueError("DraftModel.model is required: a logitloop model")

    def resolve(self, info) -> tuple[_Draft, Any]:
        draft = model_info(self.model)
        if draft.vocab_size != info.vocab_size:
            raise ValueError(
                f"DraftModel.model has vocab_size {draft.vocab_size}, the target "
                f"{info.vocab_size}: a draft needs the target's tokenizer"
            )
        spec = _Draft(
            runner=draft.runner,
            num_draft=self.num_draft,
            acceptance=self.acceptance,
            min_acceptance=self.min_acceptance,
            probe_every=self.probe_every,
            cycle_cost=self.cycle_cost,
        )
        return spec, draft.weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Draft(_Speculation):
    """A `DraftModel` as `decode` compiles against it: the draft's static runner."""

    runner: ModelRunner

    def draft_prefill(self, draft_weights, prompt, positions, cache_len, layout):
        weights, rows = _unpack(draft_weights)
        if rows is not None and rows.adapter.shape[0] != prompt.shape[0]:
            rows = rows.every(rows.adapter.shape[0] // prompt.shape[0])  # a prompt's n rows
        return loop.forward_prompt(
            self.runner, weights, prompt, positions, cache_len, layout, rows=rows
        )[1]

    def forward(self, draft_weights, tokens, positions, cache):
        """The draft over `tokens` (each row under its draft adapter, `DraftInputs`)."""
        weights, rows = _unpack(draft_weights)
        return self.runner.forward(weights, tokens, positions, cache, rows=rows)

    def catch_up(self, draft_weights, s) -> Any:
        """The draft's cache with every running row's tokens before its last two fed (rows
        that took plain steps while off lag behind): `CATCH_UP` columns a call, in a
        `while_loop` that runs no call when no row lags."""
        hist, length = s.history.tokens, s.history.length
        cap = hist.shape[1]
        upto = jnp.where(~s.done, length - 2, 0)  # the last two go in with `propose`'s call
        cols = jnp.arange(CATCH_UP)[None, :]

        def lags(carry):
            return jnp.any(carry[1] < upto)

        def feed(carry):
            cache, fed = carry
            at = fed[:, None] + cols  # [B, C]
            pos = jnp.where(at < upto[:, None], at, -1)
            tokens = jnp.maximum(jnp.take_along_axis(hist, jnp.clip(at, 0, cap - 1), axis=1), 0)
            _, cache = self.forward(draft_weights, tokens, pos, cache)
            return cache, jnp.maximum(fed, jnp.minimum(fed + CATCH_UP, upto))

        spec = s.speculation
        return jax.lax.while_loop(lags, feed, (spec.draft_cache, spec.fed))[0]

    def propose(self, draft_weights, s, params, on):
        k = self.num_draft
        hist, length = s.history.tokens, s.history.length
        running = ~s.done
        base = s.prompt_len + s.num_tokens - 1  # = length - 1, the last token's position
        prev = jnp.take_along_axis(hist, jnp.maximum(length - 2, 0)[:, None], axis=1)
        tokens = jnp.concatenate([jnp.maximum(prev, 0), loop.last_tokens(s)[:, None]], axis=1)
        pos = jnp.where(running[:, None], base[:, None] + jnp.arange(-1, 1)[None, :], -1)
        cache = self.catch_up(draft_weights, s)
        logits, cache = self.forward(draft_weights, tokens, pos, cache)
        drafts, qs = [], []
        for i in range(k):
            token, q = self.pick(logits, params, s.num_tokens + i)
            drafts.append(token)
            qs.append(q)
            if i + 1 < k:
                p_i = jnp.where(running, base + 1 + i, -1)[:, None]
                logits, cache = self.forward(draft_weights, token[:, None], p_i, cache)
        drafts = jnp.stack(drafts, axis=1)  # [B, K]
        q = None if self.acceptance == "strict" else jnp.stack(qs, axis=1)  # [B, K, V]
        num = jnp.where(running, k, 0).astype(jnp.int32)
        return drafts, num, q, cache

    def pick(self, logits, params, positions):
        """The draft's token at one position and its distribution q ([B, V]; None: greedy)."""
        greedy_tok = jnp.argmax(logits, axis=1).astype(jnp.int32)
        if self.acceptance == "strict":
            return greedy_tok, None
        greedy = (params.temperature == 0) | (params.top_k == 1)
        t = jnp.where(greedy, 1.0, params.temperature)[:, None]
        logq = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=1)
        key = sampler.sub_key(noise.row_keys(params.seed, positions), DRAFT_STREAM)
        e = noise.exponential_from_bits(
            noise.counter_bits(key[:, None, :], jnp.arange(logits.shape[1]))
        )
        sampled = jnp.argmax(logq - jnp.log(e), axis=1).astype(jnp.int32)
        token = jnp.where(greedy, greedy_tok, sampled)
        q = jnp.where(greedy[:, None], jax.nn.one_hot(token, logits.shape[1]), jnp.exp(logq))
        return token, q


@struct.dataclass
class DraftInputs:
    """A draft model's weights with its rows' adapters (`DraftModel.adapters`), as
    `Tables.draft_weights`: `rows` an `ll.Rows` of each row's slot in the draft's table
    (`[B]`, -1: the draft's base) and that table."""

    weights: Any
    rows: Rows


def _unpack(draft_weights: Any) -> tuple[Any, Rows | None]:
    """(the draft's weights, its rows' adapters or None)."""
    if isinstance(draft_weights, DraftInputs):
        return draft_weights.weights, draft_weights.rows
    return draft_weights, None
