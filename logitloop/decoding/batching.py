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
and the widths of the per-row lists in the params (bias, banned, allowed and stop ids,
stop sequences, stop strings, top logprobs). A request whose lists outgrow a width widens
it (to the next power of two, as `SamplingParams.create` buckets them) and that shape
compiles once; a second job with the same bounds and settings of the same kind compiles
nothing.

Identity with `generate`: a slot's new request starts from a fresh state row (tokens -1,
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
import types
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding import generate as gen
from logitloop.decoding import stop_strings
from logitloop.decoding.generate import (
    MIN_BUFFER_BUCKET,
    MIN_PROMPT_BUCKET,
    GenerationResult,
    bucket,
    pad_prompts,
)
from logitloop.decoding.history import History
from logitloop.decoding.loop import DecodeState, decode, prefill
from logitloop.decoding.model import FunctionModel, ModelInfo, ModelRunner, model_info
from logitloop.decoding.params import MAX_TOP_LOGPROBS, MIN_LIST_WIDTH, SamplingParams
from logitloop.decoding.stop_strings import SENTINEL, StopStrings

__all__ = ["Request", "generate_many", "iter_generate_many"]


@dataclasses.dataclass
class Request:
    """One prompt with its own settings.

    prompt: a string (needs a model with a tokenizer) or a list of token ids.
    params: `SamplingParams.create` keyword arguments for this prompt (they replace the
      job's `params` defaults key by key), or a `SamplingParams` of batch size 1, or None.
    id: anything; only used to name the request in error messages.
    """

    prompt: Any
    params: Mapping[str, Any] | SamplingParams | None = None
    id: Any = None


# --------------------------------------------------------------------------- device side


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Widths of the per-row lists; every one is a power of two, as `create` buckets them."""

    bias: int = MIN_LIST_WIDTH
    banned: int = MIN_LIST_WIDTH
    allowed: int = MIN_LIST_WIDTH
    stop_ids: int = MIN_LIST_WIDTH
    seq_q: int = MIN_LIST_WIDTH  # stop sequences per row
    seq_l: int = MIN_LIST_WIDTH  # longest stop sequence
    num_top: int = 0  # 0 or MAX_TOP_LOGPROBS
    str_q: int = 0  # stop strings per row; 0 = no stop-string tables at all
    str_l: int = 16  # longest stop string, in bytes

    def union(self, other: _Layout) -> _Layout:
        return _Layout(*(max(a, b) for a, b in zip(_astuple(self), _astuple(other), strict=True)))


def _astuple(layout: _Layout) -> tuple[int, ...]:
    return tuple(getattr(layout, f.name) for f in dataclasses.fields(layout))


# list fields of SamplingParams: (layout attribute, fill value)
_LIST_FIELDS = {
    "bias_ids": ("bias", -1),
    "bias_values": ("bias", 0),
    "banned_ids": ("banned", -1),
    "allowed_ids": ("allowed", -1),
    "stop_token_ids": ("stop_ids", -1),
}


@functools.partial(
    jax.jit,
    static_argnames=("runner", "batch", "prompt_len", "buffer_len", "num_top", "window", "text"),
)
def _empty_state(
    runner: ModelRunner,
    weights: Any,
    *,
    batch: int,
    prompt_len: int,
    buffer_len: int,
    num_top: int,
    window: int,
    text: int,
) -> DecodeState:
    """A state whose every row is an empty, finished slot (the loop never touches it)."""
    cap = prompt_len + buffer_len
    zeros = jnp.zeros((batch,), jnp.int32)
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        done=jnp.ones((batch,), bool),
        finish=zeros,
        matched=jnp.full((batch,), -1, jnp.int32),
        tokens=jnp.full((batch, buffer_len), -1, jnp.int32),
        num_tokens=zeros,
        logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
        raw_logprobs=jnp.zeros((batch, buffer_len), jnp.float32),
        top_ids=jnp.full((batch, buffer_len, num_top), -1, jnp.int32),
        top_values=jnp.full((batch, buffer_len, num_top), -jnp.inf, jnp.float32),
        prompt_len=zeros,
        cache=runner.init_cache(weights, batch, cap),
        history=History(jnp.full((batch, cap), -1, jnp.int32), zeros, zeros),
        window=jnp.full((batch, window), -1, jnp.int32),
        text_window=jnp.full((batch, text), SENTINEL, jnp.int32),
    )


@functools.partial(
    jax.jit, static_argnames=("runner", "buffer_len", "num_top"), donate_argnames=("state",)
)
def _admit(
    runner: ModelRunner,
    weights: Any,
    state: DecodeState,  # [S slots]
    params: SamplingParams,  # [S]
    stops: StopStrings | None,  # [S]
    slot: jax.Array,  # [G] i32, the slot of each new row; S (out of range) = dummy row
    prompt: jax.Array,  # [G, P] i32, left-padded
    positions: jax.Array,  # [G, P] i32, -1 on padding
    prompt_len: jax.Array,  # [G] i32
    history: jax.Array,  # [G, P + N] i32, the prompt then -1
    new_params: SamplingParams,  # [G]
    new_strings: jax.Array,  # [G, Qs, Ls] stop-string bytes (ignored without stops)
    new_lengths: jax.Array,  # [G, Qs]
    *,
    buffer_len: int,
    num_top: int,
) -> tuple[DecodeState, SamplingParams, StopStrings | None]:
    """Prefill G prompts and write their fresh rows (state, params, stop strings) into slots."""
    new_stops = None
    if stops is not None:
        new_stops = stops.replace(strings=new_strings, lengths=new_lengths)
    fresh = prefill(
        runner,
        weights,
        prompt,
        positions,
        prompt_len,
        History(history, prompt_len, prompt_len),
        new_params,
        new_stops,
        buffer_len=buffer_len,
        num_top=num_top,
    )

    def put(big, small):
        if big.ndim == 0:  # the loop's step counter is shared, not per row
            return big
        return big.at[slot].set(small.astype(big.dtype), mode="drop")

    state = jax.tree.map(put, state, fresh)
    params = jax.tree.map(put, params, new_params)
    if stops is not None:
        stops = stops.replace(
            strings=put(stops.strings, new_strings), lengths=put(stops.lengths, new_lengths)
        )
    return state, params, stops


# --------------------------------------------------------------------------- host side


@dataclasses.dataclass
class _Row:
    """One generated sequence: a request's prompt under one row of its params."""

    request: int  # index of the request in the input
    child: int  # sample index within the request (n > 1)
    ids: list[int]
    params: dict[str, np.ndarray]  # field -> [1, ...] host arrays, padded to the layout
    stop: tuple[str, ...]
    layout: _Layout


@dataclasses.dataclass
class _Pending:
    """A request admitted from the input and not yet returned."""

    index: int
    ids: list[list[int]]  # per row
    params: SamplingParams  # host copy, n rows, EOS ids added (as `generate` has them)
    want_top: bool
    outputs: list[dict[str, np.ndarray] | None]


def _describe(index: int, request_id: Any) -> str:
    return f"requests[{index}]" + ("" if request_id is None else f" (id {request_id!r})")


def _split_request(item: Any) -> tuple[Any, Any, Any]:
    """Request | (prompt, params) | prompt -> (prompt, params, id)."""
    if isinstance(item, Request):
        return item.prompt, item.params, item.id
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and (item[1] is None or isinstance(item[1], (Mapping, SamplingParams)))
    ):
        return item[0], item[1], None
    return item, None, None


def _host_params(params: SamplingParams) -> SamplingParams:
    """The same params with numpy leaves (one device-to-host copy)."""
    return jax.device_get(params)


def _row_fields(params: SamplingParams, row: int) -> dict[str, np.ndarray]:
    """Row `row` of host params as {field: [1, ...] array}, lists compacted to their entries."""
    out = {}
    for f in dataclasses.fields(SamplingParams):
        if not f.metadata.get("pytree_node", True):
            continue
        out[f.name] = np.asarray(getattr(params, f.name))[row : row + 1]
    return out


def _count_width(arr: np.ndarray, minimum: int = MIN_LIST_WIDTH) -> int:
    return bucket(int(np.max((arr >= 0).sum(axis=-1), initial=0)), minimum)


def _row_layout(fields: dict[str, np.ndarray], stop: Sequence[str]) -> _Layout:
    seqs = fields["stop_sequences"][0]  # [Q, L], right-aligned
    used = seqs >= 0
    q = int(np.any(used, axis=1).sum())
    longest = int(used.sum(axis=1).max(initial=0))
    encoded = [s.encode("utf-8") for s in stop]
    return _Layout(
        bias=_count_width(fields["bias_ids"]),
        banned=_count_width(fields["banned_ids"]),
        allowed=_count_width(fields["allowed_ids"]),
        stop_ids=_count_width(fields["stop_token_ids"]),
        seq_q=bucket(q, 1),
        seq_l=bucket(longest, 1),
        num_top=MAX_TOP_LOGPROBS if int(fields["logprobs"][0]) > 0 else 0,
        str_q=bucket(len(encoded), 4) if encoded else 0,
        str_l=bucket(max((len(s) for s in encoded), default=1), 16),
    )


def _fit(fields: dict[str, np.ndarray], layout: _Layout) -> dict[str, np.ndarray]:
    """Pad (or compact) per-row params arrays [B, ...] to the layout's widths."""
    out = dict(fields)
    for name, (attr, fill) in _LIST_FIELDS.items():
        arr = fields[name]
        width = getattr(layout, attr)
        if name.startswith("bias"):  # ids and values move together: keep the columns
            keep = fields["bias_ids"] >= 0
        else:
            keep = arr >= 0
        new = np.full((arr.shape[0], width), fill, arr.dtype)
        for r in range(arr.shape[0]):
            vals = arr[r][keep[r]]
            new[r, : len(vals)] = vals
        out[name] = new
    seqs = fields["stop_sequences"]
    new = np.full((seqs.shape[0], layout.seq_q, layout.seq_l), -1, np.int32)
    for r in range(seqs.shape[0]):
        j = 0
        for s in seqs[r]:
            s = s[s >= 0]
            if len(s):
                new[r, j, layout.seq_l - len(s) :] = s
                j += 1
    out["stop_sequences"] = new
    return out


def _stop_rows(stops: Sequence[Sequence[str]], layout: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """Stop strings of G rows as ([G, Qs, Ls] bytes, SENTINEL-padded; [G, Qs] lengths)."""
    q, length = max(layout.str_q, 1), layout.str_l
    strings = np.full((len(stops), q, length), SENTINEL, np.int32)
    lengths = np.zeros((len(stops), q), np.int32)
    for i, row in enumerate(stops):
        for j, s in enumerate(row):
            b = s.encode("utf-8")
            strings[i, j, : len(b)] = np.frombuffer(b, np.uint8)
            lengths[i, j] = len(b)
    return strings, lengths


def _stack(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([r[k] for r in rows], axis=0) for k in rows[0]}


def _to_params(fields: dict[str, np.ndarray], device: bool = True) -> SamplingParams:
    """Params from per-field arrays: on the device, or numpy (for arguments of one call)."""
    return SamplingParams(**(jax.device_put(fields) if device else fields))


def _check_int(name: str, value: Any, lo: int, hi: float = float("inf")) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        top = "inf" if hi == float("inf") else str(int(hi))
        raise ValueError(f"{name} = {value!r} is outside the allowed range [{lo}, {top}]")
    return int(value)


def _request_params(host: SamplingParams, row: int, n: int) -> SamplingParams:
    """Row `row` of host params repeated for `n` samples, with `generate`'s child seeds."""
    arrays = jax.tree.map(
        lambda x: np.repeat(np.asarray(x)[row : row + 1], n, axis=0), host.device_only()
    )
    if n > 1:
        seed = int(host.seed[row])
        arrays = arrays.replace(
            seed=np.asarray([gen._child_seed(seed, c) for c in range(n)], np.uint32)
        )
    return dataclasses.replace(
        arrays,
        stop=(host.stop[row],) * n if host.stop else (),
        include_stop_str_in_output=(host.include_stop_str_in_output[row],) * n
        if host.include_stop_str_in_output
        else (),
    )


class _Batcher:
    """The slot state and the scheduling loop behind `iter_generate_many`."""

    def __init__(
        self,
        info: ModelInfo,
        *,
        slots: int,
        max_prompt_len: int,
        max_tokens: int,
        chunk_steps: int,
        prefill_batch: int,
        defaults: Mapping[str, Any],
        n: int,
        ignore_eos: bool,
    ):
        self.info = info
        self.slots = slots
        self.max_prompt_len = max_prompt_len
        self.max_tokens = max_tokens
        self.prompt_len = bucket(max_prompt_len, MIN_PROMPT_BUCKET)
        self.buffer_len = bucket(max_tokens, MIN_BUFFER_BUCKET)
        self.chunk_steps = chunk_steps
        self.group = prefill_batch
        self.defaults = dict(defaults)
        self.n = n
        self.ignore_eos = ignore_eos
        # prepare() without re-splitting an NNX model for every request
        self._checker = FunctionModel(
            apply_fn=None,
            params=None,
            init_cache=None,
            vocab_size=info.vocab_size,
            max_length=info.max_length,
            eos_token_ids=info.eos_token_ids,
            tokenizer=info.tokenizer,
        )
        self._token_bytes = None
        self.layout = _Layout()
        self.state: DecodeState | None = None
        self.params: SamplingParams | None = None
        self.stops: StopStrings | None = None

    # ------------------------------------------------------------------ requests

    def prepare(self, index: int, item: Any) -> tuple[_Pending, list[_Row]]:
        """Tokenize and validate one request; returns its record and its `n` rows.

        One request at a time (`SamplingParams.create` of batch 1): the shapes of the small
        host-side arrays then depend only on the request's own settings, so a second job
        with settings of the same kinds compiles nothing at all.
        """
        prompt, knobs, request_id = _split_request(item)
        where = _describe(index, request_id)
        try:
            if isinstance(knobs, SamplingParams):
                params = knobs
                if params.batch_size != 1:
                    raise ValueError(
                        f"params has batch_size {params.batch_size}; a request needs batch_size 1"
                    )
            elif knobs is None or isinstance(knobs, Mapping):
                params = SamplingParams.create(1, **{**self.defaults, **(knobs or {})})
            else:
                raise ValueError(f"params must be a dict or a SamplingParams, got {knobs!r}")
            if isinstance(prompt, np.ndarray):
                prompt = prompt.tolist()
            _, ids, params = gen.prepare(
                self._checker, [prompt], params, ignore_eos=self.ignore_eos
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}".replace("prompts[0]", "the prompt")) from None
        host = _host_params(params)
        if len(ids[0]) > self.max_prompt_len:
            raise ValueError(
                f"{where}: the prompt has {len(ids[0])} tokens, over max_prompt_len = "
                f"{self.max_prompt_len}"
            )
        if int(host.max_tokens[0]) > self.max_tokens:
            raise ValueError(
                f"{where}: max_tokens = {int(host.max_tokens[0])} is over the job's "
                f"max_tokens bound {self.max_tokens}"
            )
        stop = host.stop[0] if host.stop else ()
        if stop and self.info.tokenizer is None:
            raise ValueError(f"{where}: stop strings need a model that carries a tokenizer")
        mine = _request_params(host, 0, self.n)
        rows = []
        for child in range(self.n):
            fields = _row_fields(mine, child)
            rows.append(_Row(index, child, ids[0], fields, stop, _row_layout(fields, stop)))
        pending = _Pending(
            index=index,
            ids=[ids[0]] * self.n,
            params=mine,
            want_top=int(host.logprobs[0]) > 0,
            outputs=[None] * self.n,
        )
        return pending, rows

    # ------------------------------------------------------------------ device state

    def _text_width(self, layout: _Layout) -> int:
        if layout.str_q == 0:
            return 0
        return layout.str_l - 1 + self._tokens_table().bytes.shape[1]

    def _tokens_table(self):
        if self._token_bytes is None:
            self._token_bytes = stop_strings.token_bytes(self.info.tokenizer, self.info.vocab_size)
        return self._token_bytes

    def _start(self, layout: _Layout) -> None:
        self.layout = layout
        self.state = _empty_state(
            self.info.runner,
            self.info.weights,
            batch=self.slots,
            prompt_len=self.prompt_len,
            buffer_len=self.buffer_len,
            num_top=layout.num_top,
            window=layout.seq_l,
            text=self._text_width(layout),
        )
        # Empty slots are greedy: no row of theirs makes the sampler take its slow paths.
        base = _host_params(SamplingParams.create(1, temperature=0.0))
        fields = _fit(_row_fields(base, 0), layout)
        self.params = _to_params({k: np.repeat(v, self.slots, axis=0) for k, v in fields.items()})
        self.stops = None
        if layout.str_q:
            strings, lengths = _stop_rows([()] * self.slots, layout)
            self.stops = StopStrings(
                tokens=self._tokens_table(),
                strings=jax.device_put(strings),
                lengths=jax.device_put(lengths),
            )

    def _grow(self, layout: _Layout) -> None:
        """Widen the per-row lists of the live state (a new shape: compiles once)."""
        old = self.layout
        self.layout = layout
        host = _host_params(self.params)
        self.params = _to_params(_fit(_row_fields_all(host), layout))
        s = self.state
        window = np.asarray(s.window)
        if layout.seq_l > old.seq_l:  # older tokens are not needed by the shorter sequences
            pad = np.full((self.slots, layout.seq_l - old.seq_l), -1, np.int32)
            window = np.concatenate([pad, window], axis=1)
        text = np.asarray(s.text_window)
        width = self._text_width(layout)
        if width > text.shape[1]:
            pad = np.full((self.slots, width - text.shape[1]), SENTINEL, np.int32)
            text = np.concatenate([pad, text], axis=1)
        top_ids, top_values = s.top_ids, s.top_values
        if layout.num_top > old.num_top:
            shape = (self.slots, self.buffer_len, layout.num_top)
            top_ids = jax.device_put(np.full(shape, -1, np.int32))
            top_values = jax.device_put(np.full(shape, -np.inf, np.float32))
        self.state = s.replace(
            window=jax.device_put(window),
            text_window=jax.device_put(text),
            top_ids=top_ids,
            top_values=top_values,
        )
        if layout.str_q:
            if self.stops is None:
                strings, lengths = _stop_rows([()] * self.slots, layout)
            else:
                strings = np.asarray(self.stops.strings)
                lengths = np.asarray(self.stops.lengths)
                q, length = strings.shape[1:]
                strings = np.pad(
                    strings,
                    ((0, 0), (0, layout.str_q - q), (0, layout.str_l - length)),
                    constant_values=SENTINEL,
                )
                lengths = np.pad(lengths, ((0, 0), (0, layout.str_q - q)))
            self.stops = StopStrings(
                tokens=self._tokens_table(),
                strings=jax.device_put(strings),
                lengths=jax.device_put(lengths),
            )

    def admit(self, rows: Sequence[_Row], free: list[int]) -> list[int]:
        """Prefill `rows` into slots taken from `free`; returns the slots used."""
        need = self.layout
        for row in rows:
            need = need.union(row.layout)
        if self.state is None:
            self._start(need)
        elif need != self.layout:
            self._grow(need)
        layout = self.layout
        used = []
        plen, cap = self.prompt_len, self.prompt_len + self.buffer_len
        for start in range(0, len(rows), self.group):
            group = list(rows[start : start + self.group])
            slot = np.full((self.group,), self.slots, np.int32)  # dummies: dropped
            for i in range(len(group)):
                slot[i] = free.pop(0)
                used.append(int(slot[i]))
            real = len(group)
            group += [group[0]] * (self.group - real)
            prompt, positions, hist, lens = pad_prompts([row.ids for row in group], plen, cap)
            fields = _stack([_fit(row.params, layout) for row in group])
            strings, lengths = _stop_rows([row.stop for row in group], layout)
            self.state, self.params, self.stops = _admit(
                self.info.runner,
                self.info.weights,
                self.state,
                self.params,
                self.stops,
                slot,
                prompt,
                positions,
                lens,
                hist,
                _to_params(fields, device=False),
                strings,
                lengths,
                buffer_len=self.buffer_len,
                num_top=layout.num_top,
            )
        return used

    def dispatch(self) -> None:
        """Start one chunk of decode steps (asynchronously: the host carries on)."""
        state = self.state.replace(step=np.int32(0))
        self.state = decode(
            self.info.runner,
            self.info.weights,
            state,
            self.params,
            self.stops,
            np.int32(self.chunk_steps),
        )

    def done(self) -> np.ndarray:
        """Wait for the chunk; the host copy of every slot's `done`."""
        return np.asarray(jax.device_get(self.state.done))

    def fetch(self, slots: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Copy the finished rows in `slots` to the host."""
        s = self.state
        names = ["tokens", "num_tokens", "finish", "matched", "logprobs", "raw_logprobs"]
        if self.layout.num_top:
            names += ["top_ids", "top_values"]
        arrays = dict(zip(names, jax.device_get(tuple(getattr(s, k) for k in names)), strict=True))
        out = []
        for slot in slots:
            k = int(arrays["num_tokens"][slot])
            row = {
                "num_tokens": k,
                "finish": int(arrays["finish"][slot]),
                "matched": int(arrays["matched"][slot]),
            }
            for name in ("tokens", "logprobs", "raw_logprobs", "top_ids", "top_values"):
                if name in arrays:
                    row[name] = np.array(arrays[name][slot, :k])
            out.append(row)
        return out

    # ------------------------------------------------------------------ results

    def result(self, pending: _Pending) -> GenerationResult:
        """The request's rows as `generate` would return them for that prompt alone."""
        outs = pending.outputs
        n = len(outs)
        kmax = max(1, max(o["num_tokens"] for o in outs))
        tokens = np.full((n, kmax), -1, np.int32)
        lp = np.zeros((n, kmax), np.float32)
        raw = np.zeros((n, kmax), np.float32)
        top = MAX_TOP_LOGPROBS if pending.want_top else 0
        top_ids = np.full((n, kmax, top), -1, np.int32)
        top_values = np.full((n, kmax, top), -np.inf, np.float32)
        for r, o in enumerate(outs):
            k = o["num_tokens"]
            tokens[r, :k] = o["tokens"]
            lp[r, :k] = o["logprobs"]
            raw[r, :k] = o["raw_logprobs"]
            if top:
                top_ids[r, :k] = o["top_ids"]
                top_values[r, :k] = o["top_values"]
        state = types.SimpleNamespace(
            tokens=tokens,
            num_tokens=np.asarray([o["num_tokens"] for o in outs], np.int32),
            finish=np.asarray([o["finish"] for o in outs], np.int32),
            matched=np.asarray([o["matched"] for o in outs], np.int32),
            logprobs=lp,
            raw_logprobs=raw,
            top_ids=top_ids,
            top_values=top_values,
        )
        return gen.collect(state, pending.ids, pending.params, self.info)

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Iterable[Any]) -> Iterator[tuple[int, GenerationResult]]:
        """Admit, decode a chunk, collect; host work overlaps the device's chunk.

        While a chunk runs on the device, the host yields the results of the previous
        chunk and reads (tokenizes, validates) up to `prefill_batch` requests ahead.
        """
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
            if waiting and free:
                take = [waiting.popleft() for _ in range(min(len(waiting), len(free)))]
                for slot, row in zip(self.admit(take, free), take, strict=True):
                    occupant[slot] = row
            if occupant:
                self.dispatch()
            for index in ready:
                yield index, self.result(pending.pop(index))
            ready = []
            if not occupant:
                return
            read(self.group)
            done = self.done()
            finished = sorted(slot for slot in occupant if done[slot])
            if not finished:
                continue
            for slot, out in zip(finished, self.fetch(finished), strict=True):
                row = occupant.pop(slot)
                free.append(slot)
                request = pending[row.request]
                request.outputs[row.child] = out
                if all(o is not None for o in request.outputs):
                    ready.append(row.request)
            free.sort()
            ready.sort()


def _row_fields_all(params: SamplingParams) -> dict[str, np.ndarray]:
    return {
        f.name: np.asarray(getattr(params, f.name))
        for f in dataclasses.fields(SamplingParams)
        if f.metadata.get("pytree_node", True)
    }


# --------------------------------------------------------------------------- public API


def _bounds_from(
    info: ModelInfo, items: Sequence[Any], defaults: Mapping[str, Any]
) -> tuple[int, int]:
    """Longest prompt and largest max_tokens of a list of requests (0 when unknown)."""
    longest, most = 1, 1
    for item in items:
        prompt, knobs, _ = _split_request(item)
        if isinstance(prompt, str):
            if info.tokenizer is None:
                continue  # reported with the request's index later
            length = len(info.tokenizer.encode(prompt))
        else:
            try:
                length = len(prompt)
            except TypeError:
                continue
        if isinstance(knobs, SamplingParams):
            mt = int(np.max(np.asarray(knobs.max_tokens)))
        else:
            mt = {**defaults, **(knobs or {})}.get("max_tokens", 16)
            try:
                mt = int(np.max(np.asarray(mt)))
            except (TypeError, ValueError):
                continue
        longest, most = max(longest, length), max(most, mt)
    return longest, most


def iter_generate_many(
    model: Any,
    requests: Iterable[Any],
    params: Mapping[str, Any] | None = None,
    *,
    slots: int = 16,
    chunk_steps: int = 8,
    prefill_batch: int | None = None,
    max_prompt_len: int | None = None,
    max_tokens: int | None = None,
    n: int = 1,
    ignore_eos: bool = False,
) -> Iterator[tuple[int, GenerationResult]]:
    """Like `generate_many`, but yields `(index, result)` as each request completes.

    Requests are read from `requests` lazily, so it may be a generator: enough to fill the
    free slots, plus up to `prefill_batch` rows ahead (tokenized and validated while the
    device runs a chunk). A bad request raises `ValueError` naming its index when it is
    read; results that completed before have been yielded by then.
    """
    info = model_info(model)
    slots = _check_int("slots", slots, 1)
    chunk_steps = _check_int("chunk_steps", chunk_steps, 1)
    group = min(4, -(-slots // 8)) if prefill_batch is None else prefill_batch
    group = _check_int("prefill_batch", group, 1, slots)
    n = _check_int("n", n, 1)
    if not isinstance(params, (Mapping, type(None))):
        raise ValueError(
            f"params must be a dict of SamplingParams.create arguments, got {params!r}"
        )
    defaults = dict(params or {})
    if isinstance(requests, (str, bytes)):
        raise ValueError("requests must be an iterable of requests, not a string")
    if isinstance(requests, Sequence) and (max_prompt_len is None or max_tokens is None):
        longest, most = _bounds_from(info, requests, defaults)
        max_prompt_len = longest if max_prompt_len is None else max_prompt_len
        max_tokens = most if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = info.max_length - 1
    if max_prompt_len is None:
        max_prompt_len = info.max_length - 1
    max_prompt_len = _check_int("max_prompt_len", max_prompt_len, 1, info.max_length - 1)
    max_tokens = _check_int("max_tokens", max_tokens, 1, info.max_length - 1)
    batcher = _Batcher(
        info,
        slots=slots,
        max_prompt_len=max_prompt_len,
        max_tokens=max_tokens,
        chunk_steps=chunk_steps,
        prefill_batch=group,
        defaults=defaults,
        n=n,
        ignore_eos=ignore_eos,
    )
    return batcher.run(requests)


def generate_many(
    model: Any,
    requests: Iterable[Any],
    params: Mapping[str, Any] | None = None,
    *,
    slots: int = 16,
    chunk_steps: int = 8,
    prefill_batch: int | None = None,
    max_prompt_len: int | None = None,
    max_tokens: int | None = None,
    n: int = 1,
    ignore_eos: bool = False,
) -> list[GenerationResult]:
    """Generate completions for many prompts with continuous batching; results in input order.

    requests: any iterable (a generator too) of `Request(prompt, params, id)`,
      `(prompt, params)` pairs or bare prompts; a prompt is a string (with a tokenizer) or a
      list of token ids; a request's params are `SamplingParams.create` keyword arguments
      (or a `SamplingParams` of batch size 1) and replace the job-wide `params` defaults.
    slots: rows decoded together. chunk_steps: decode steps between admissions.
    prefill_batch: prompts prefilled per admission call (a fixed shape; default
      `ceil(slots / 8)`, at most 4); a call with fewer waiting prompts pads with dummy rows.
    max_prompt_len, max_tokens: bounds that fix the prompt bucket and the buffer (and so
      the cache) for the whole job. Default: from the requests when they are a sequence,
      else the model's context (correct, but a larger cache than needed: pass bounds for
      a generator). A request over a bound raises ValueError.
    n, ignore_eos: as in `generate`.

    Returns one `GenerationResult` per request, each holding that prompt's `n` rows, equal to
    `generate(model, [prompt], SamplingParams.create(1, **knobs), n=n)`.
    """
    out: dict[int, GenerationResult] = {}
    for index, result in iter_generate_many(
        model,
        requests,
        params,
        slots=slots,
        chunk_steps=chunk_steps,
        prefill_batch=prefill_batch,
        max_prompt_len=max_prompt_len,
        max_tokens=max_tokens,
        n=n,
        ignore_eos=ignore_eos,
    ):
        out[index] = result
    return [out[i] for i in range(len(out))]
