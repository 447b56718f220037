"""Per-row sampling parameters: host-side validation, device-side pytree.

`SamplingParams.create` is the only place user values enter the sampler. It validates every
knob on the host (raising `ValueError` that names the argument, the row and the allowed
range), broadcasts scalars to the batch, and returns a pytree of device arrays. Every field
has a leading batch axis, so one compiled sampler serves any mix of per-row settings:
changing a value never recompiles.

Lists whose length varies (banned ids, bias entries, stop ids, stop sequences) are padded
with -1 to a width rounded up to a power of two (at least `MIN_LIST_WIDTH`), so that a new
list length recompiles only when it outgrows its bucket.

`SamplingParams` is composed of parts with one job each, and keeps every field as an
attribute of its own (`params.temperature` is `params.knobs.temperature`; `replace`
takes the fields by those names too):

- `knobs` (`SamplerKnobs`): how a row's logits become a draw (temperature, truncation,
  penalties, bias, banned and allowed ids, seed): what the sampler reads;
- `stops` (`StopRules`): when a row ends (max and min tokens, stop ids, stop sequences,
  stop strings);
- `output` (`OutputOptions`): what is reported beside the tokens (top logprobs and their
  static width, stop strings in the text);
- `constraints`: each row's structured-output constraint;
- `processors`: the user's logits processors.

Stop strings (`stop`) are host-side metadata: they are not a pytree leaf. `generate` and
`stream` turn them into device tables (see `logitloop.decoding.loop.stop_strings`). So are the
constraints (`json_schema`, `regex`, `choice`): `generate` compiles them against the model's
vocabulary into device automata (`logitloop.decoding.sampling.constraints`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling.checks import (
    _F32_MAX,
    _MAX_INT32,
    _MIN_TEMPERATURE,
    MAX_SEED,
    MAX_TOP_LOGPROBS,
    MIN_LIST_WIDTH,
    Widths,
    _bias_rows,
    _check_ids,
    _check_range,
    _id_lists,
    _is_list,
    _not_an_id,
    _pad_ids,
    _per_row,
    _repetition_guard,
    _stop_sequences,
    _stop_strings,
    bucket_width,
    child_seed,
    is_token_id,
    row_name,
)
from logitloop.models.generation_config import read_generation_config


@struct.dataclass
class SamplerKnobs:
    """How each row's logits become a draw: what the sampler reads
    (`logitloop.decoding.sampling.sampler`, the order in `sample`). Every field `[B, ...]`."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, <= 0 or >= vocab disables
    top_p: jax.Array  # [B] f32 in (0, 1], 1 disables
    min_p: jax.Array  # [B] f32 in [0, 1], 0 disables
    repetition_penalty: jax.Array  # [B] f32 > 0, 1 disables
    presence_penalty: jax.Array  # [B] f32 in [-2, 2]
    frequency_penalty: jax.Array  # [B] f32 in [-2, 2]
    bias_ids: jax.Array  # [B, Nb] i32, -1 = unused slot
    bias_values: jax.Array  # [B, Nb] f32
    banned_ids: jax.Array  # [B, Nn] i32, -1 = unused slot
    allowed_ids: jax.Array  # [B, Na] i32, -1 = unused slot
    has_allowed: jax.Array  # [B] bool, whether allowed_ids restricts the row
    seed: jax.Array  # [B] u32


@struct.dataclass
class StopRules:
    """When each row ends: the loop's bounds, stop ids and sequences (device), stop strings
    (host). `min_tokens` also keeps the stop ids from being drawn before it
    (`transforms.suppress_stop_tokens`)."""

    max_tokens: jax.Array  # [B] i32 >= 1
    min_tokens: jax.Array  # [B] i32 in [0, max_tokens]
    stop_token_ids: jax.Array  # [B, Ns] i32, -1 = unused slot
    stop_sequences: jax.Array  # [B, Q, L] i32, each sequence right-aligned, -1 padded
    # The repetition guard (`repetition_guard=(max_period, min_repeats)`): the row ends with
    # finish reason "repetition" once its last generated tokens repeat a period of at most
    # `guard_period` tokens `guard_repeats` times (`loop.repetition`).
    guard_period: jax.Array  # [B] i32 in [0, MAX_GUARD_PERIOD], 0 = off
    guard_repeats: jax.Array  # [B] i32 >= 2 (0 when off)
    stop: tuple[tuple[str, ...], ...] = struct.field(pytree_node=False, default=())


@struct.dataclass
class OutputOptions:
    """What each row reports beside its tokens."""

    logprobs: jax.Array  # [B] i32 in [0, MAX_TOP_LOGPROBS]: top-n raw alternatives
    # The width of the top logprobs the sampler returns: the most any row asks for (0: none).
    # Static (part of the compiled program's shape), known on the host when the params are
    # made, so arrays are exactly as wide as the widest row asked without a device read.
    top_logprobs_width: int = struct.field(pytree_node=False, default=0)
    include_stop_str_in_output: tuple[bool, ...] = struct.field(pytree_node=False, default=())


# The part that holds each field, by the field's name (`SamplingParams.replace`).
PARTS = {
    name: part
    for part, cls in (("knobs", SamplerKnobs), ("stops", StopRules), ("output", OutputOptions))
    for name in (f.name for f in dataclasses.fields(cls))
}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["knobs", "stops", "output", "processors"],
    meta_fields=["constraints", "vocab_size", "broadcasts"],
)
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for a batch, one row per request. Build with `SamplingParams.create`.

    Every array has a leading batch axis `B`; the sampler reads row `r` of each one. The
    parts (module docstring) each hold one kind of setting; every field of a part is also
    an attribute here (`params.top_p`, `params.max_tokens`, `params.stop`, ...).
    The order in which the knobs act is fixed (see `logitloop.decoding.sampling.sampler.sample`).
    """

    knobs: SamplerKnobs
    stops: StopRules
    output: OutputOptions
    # User processors (`logitloop.decoding.sampling.processors`): pytrees whose leaves have a
    # leading row axis, so rows are taken, repeated and placed with the other fields.
    processors: tuple = ()
    # Each row's `constraints.Constraint` or None; () when no row has one.
    constraints: tuple = ()
    # The vocabulary size every token id was checked against (create's `vocab_size`), or
    # None. Static: `sample` checks it against the logits' V when it traces, without
    # reading an id back from the device.
    vocab_size: int | None = None
    # True for params made without a batch_size (`create()`): one row that every entry point
    # repeats to its batch (`broadcast_to`), as vLLM's one SamplingParams serves every prompt.
    broadcasts: bool = False

    def replace(self, **updates: Any) -> SamplingParams:
        """The same params with `updates`, by field name (a part's fields included)."""
        if "logprobs" in updates and "top_logprobs_width" not in updates:
            # A new width with new values, when they are on the host or a device (a traced
            # value keeps the width: rows past it then get that many alternatives).
            value = updates["logprobs"]
            if not isinstance(value, jax.core.Tracer):
                updates = {**updates, "top_logprobs_width": int(np.max(value, initial=0))}
        own = {k: v for k, v in updates.items() if k not in PARTS}
        by_part: dict[str, dict[str, Any]] = {}
        for name, value in updates.items():
            if name in PARTS:
                by_part.setdefault(PARTS[name], {})[name] = value
        for part, changes in by_part.items():
            own[part] = getattr(self, part).replace(**changes)
        return dataclasses.replace(self, **own)

    @property
    def batch_size(self) -> int:
        return self.knobs.temperature.shape[0]

    @classmethod
    def create(
        cls,
        batch_size: int | None = None,
        *,
        temperature: Any = 1.0,
        top_k: Any = 0,
        top_p: Any = 1.0,
        min_p: Any = 0.0,
        repetition_penalty: Any = 1.0,
        presence_penalty: Any = 0.0,
        frequency_penalty: Any = 0.0,
        logit_bias: Any = None,
        banned_token_ids: Any = None,
        allowed_token_ids: Any = None,
        seed: Any = 0,
        max_tokens: Any = None,
        min_tokens: Any = 0,
        stop_token_ids: Any = None,
        stop_sequences: Any = None,
        stop: Any = None,
        include_stop_str_in_output: Any = False,
        logprobs: Any = 0,
        json_schema: Any = None,
        regex: Any = None,
        choice: Any = None,
        vocab_size: int | None = None,
        max_new_tokens: Any = None,
        repetition_guard: Any = None,
    ) -> SamplingParams:
        """Validate the knobs on the host and build the per-row device pytree.

        Without `batch_size` (`SamplingParams.create(temperature=0.8, top_p=0.95)`) the
        params hold one row that every entry point (`sample`, `generate`, `stream`,
        `generate_many` requests, `score`, `beam_search`, `chat`, ...) repeats to its batch
        (`broadcast_to`); each knob then takes a scalar. With `batch_size`, the params have
        exactly that many rows and fit only a batch of that size.

        `max_tokens` (default `DEFAULT_MAX_TOKENS` = 16) bounds the generated tokens of a
        row; `max_new_tokens` is its alias (transformers' name): give one or the other.
        `seed` (default 0 for every row): the library takes explicit seeds, as JAX does, so
        the same call gives the same tokens; pass a different seed per call (or row) for
        different draws.

        Each scalar knob takes a scalar (every row) or a sequence of `batch_size` values.
        List knobs (`banned_token_ids`, `allowed_token_ids`, `stop_token_ids`) take one list
        for every row or one list (or None) per row; `logit_bias` takes one dict
        `{token_id: bias}` or one per row; `stop` one string, a list of strings, or one list
        per row; `stop_sequences` a list of token-id lists, or one such list per row.

        Constraints (structured output; at most one per row, None = unconstrained):
        `json_schema` a dict or JSON string, `regex` a string (matched in full), `choice` a
        list of strings; each one for every row or a list of one (or None) per row. The
        sampler then draws only tokens that keep the text a prefix of an accepted document,
        EOS only where the document is complete, and a row whose document can only end
        stops with finish_reason "stop" (`logitloop.decoding.sampling.constraints`). A constrained
        row takes no `min_tokens`, `stop` or `stop_sequences` (ValueError): it ends when its
        document is complete and only then; a `stop_token_ids` entry that the constraint can
        write is refused too, when the model's vocabulary is known (`generate`). JSON
        schemas outside the subset translated exactly are refused
        (`logitloop.decoding.sampling.schema_subset`).

        `repetition_guard` (default None: off): `(max_period, min_repeats)` for every row, or
        one such pair (or None) per row. A row whose last generated tokens repeat a period of
        at most `max_period` tokens (1 to 32) at least `min_repeats` times (2 to 65536) ends
        there, on device, with finish reason "repetition"; its tokens and text keep
        everything generated.

        `vocab_size`, when given, bounds every token id, and `sample` checks it against the
        logits' V when it traces (ids past the logits' vocabulary are an error, not dropped);
        `generate` checks the ids against the model's vocabulary in any case. Raises
        `ValueError` naming the argument, the row and the allowed range.
        """
        broadcasts = batch_size is None
        if broadcasts:
            batch_size = 1
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size} is outside the allowed range [1, inf)")
        b = int(batch_size)
        if vocab_size is not None and (
            not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1
        ):
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        inf = math.inf
        max_tokens = canonical_knobs({"max_tokens": max_tokens, "max_new_tokens": max_new_tokens})[
            "max_tokens"
        ]
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS

        def rows(name: str, value: Any, lo: float, hi: float, **kind: bool) -> np.ndarray:
            return _check_range(name, _per_row(name, value, b), lo, hi, **kind)

        temp = rows("temperature", temperature, 0, inf, hi_open=True, normal=False)
        for row, t in enumerate(temp):
            if 0 < t < _MIN_TEMPERATURE:  # 1 / T would overflow float32
                raise ValueError(
                    f"{row_name('temperature', row, b)} = {t} is outside the allowed range: "
                    f"0 (greedy) or [{_MIN_TEMPERATURE:.6g}, {_F32_MAX:.6g}]"
                )
        k = rows("top_k", top_k, -_MAX_INT32, _MAX_INT32, integer=True)
        p = rows("top_p", top_p, 0, 1, lo_open=True)
        mp = rows("min_p", min_p, 0, 1)
        rep = rows("repetition_penalty", repetition_penalty, 0, inf, lo_open=True, hi_open=True)
        pres = rows("presence_penalty", presence_penalty, -2, 2)
        freq = rows("frequency_penalty", frequency_penalty, -2, 2)
        seeds = rows("seed", seed, 0, MAX_SEED, integer=True)
        max_t = rows("max_tokens", max_tokens, 1, _MAX_INT32, integer=True)
        min_t = rows("min_tokens", min_tokens, 0, _MAX_INT32, integer=True)
        for row in range(b):
            if min_t[row] > max_t[row]:
                raise ValueError(
                    f"{row_name('min_tokens', row, b)} = {min_t[row]} is outside the allowed "
                    f"range [0, {row_name('max_tokens', row, b)} = {max_t[row]}]"
                )
        n_logprobs = rows("logprobs", logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
        guard_period, guard_repeats = _repetition_guard(repetition_guard, b)

        bias_rows = _bias_rows(logit_bias, b)
        bias_ids = [[] for _ in range(b)]
        bias_vals = [[] for _ in range(b)]
        for row, d in enumerate(bias_rows):
            for tok, val in d.items():
                at = row_name("logit_bias", row, b)
                if not is_token_id(tok):
                    raise ValueError(f"{at} has key {tok!r}; keys must be token ids")
                where = f"{at} token {tok}: bias"
                fval = _check_range("logit_bias", [val], -100, 100, where=where)[0]
                bias_ids[row].append(int(tok))
                bias_vals[row].append(float(fval))
        _check_ids("logit_bias", bias_ids, vocab_size)
        banned = _id_lists("banned_token_ids", banned_token_ids, b)
        _check_ids("banned_token_ids", banned, vocab_size)
        if allowed_token_ids is None:
            allowed, has_allowed = [[] for _ in range(b)], [False] * b
        elif is_token_id(allowed_token_ids):
            allowed, has_allowed = [[int(allowed_token_ids)] for _ in range(b)], [True] * b
        else:
            if not _is_list(allowed_token_ids):
                raise ValueError(
                    "allowed_token_ids must be a list of token ids or one list (or None) per "
                    f"row, got {allowed_token_ids!r}"
                )
            raw = list(allowed_token_ids)
            if not any(r is None or _is_list(r) for r in raw):
                for x in raw:
                    if not is_token_id(x):
                        raise _not_an_id("allowed_token_ids", x)
                if not raw:
                    raise ValueError("allowed_token_ids is empty: pass None to allow every token")
                allowed, has_allowed = [list(map(int, raw)) for _ in range(b)], [True] * b
            else:
                if len(raw) != b:
                    raise ValueError(
                        f"allowed_token_ids has {len(raw)} per-row lists but batch_size is {b}"
                    )
                has_allowed = [r is not None for r in raw]
                allowed = _id_lists(
                    "allowed_token_ids", [r if r is not None else [] for r in raw], b
                )
                for row, (ids, has) in enumerate(zip(allowed, has_allowed, strict=True)):
                    if has and not ids:
                        raise ValueError(
                            f"{row_name('allowed_token_ids', row, b)} is empty: pass None to "
                            "allow every token"
                        )
        _check_ids("allowed_token_ids", allowed, vocab_size)
        stops = _id_lists("stop_token_ids", stop_token_ids, b)
        _check_ids("stop_token_ids", stops, vocab_size)
        stop_strs = _stop_strings(stop, b)
        include = _per_row("include_stop_str_in_output", include_stop_str_in_output, b)
        for row, v in enumerate(include):
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(
                    f"{row_name('include_stop_str_in_output', row, b)} = {v!r} must be True or "
                    "False"
                )

        constrained = constraints.parse(json_schema, regex, choice, b)
        stop_seqs = _stop_sequences(stop_sequences, b, vocab_size)
        for row, c in enumerate(constrained):
            # A constrained row ends when its document is complete; ending it earlier (a stop
            # string or sequence) or forcing it on (min_tokens) would break the document.
            clash = [
                name
                for name, given in (
                    ("min_tokens", min_t[row] > 0),
                    ("stop", bool(stop_strs[row])),
                    ("stop_sequences", bool(np.any(stop_seqs[row] >= 0))),
                )
                if given
            ]
            if c is not None and clash:
                raise ValueError(
                    f"row {row} has {c.kind} and {' and '.join(clash)}: a constrained row ends "
                    "when its document is complete, and only then, so it takes neither"
                )

        nb = bucket_width(max(len(r) for r in bias_ids))
        bias_val_arr = np.zeros((b, nb), np.float32)
        for i, vals in enumerate(bias_vals):
            bias_val_arr[i, : len(vals)] = vals
        # Host arrays, moved in one transfer (a device_put per leaf costs more than the
        # rest of create for a request of one row).
        knobs = SamplerKnobs(
            temperature=np.asarray(temp, np.float32),
            top_k=np.asarray(k, np.int32),
            top_p=np.asarray(p, np.float32),
            min_p=np.asarray(mp, np.float32),
            repetition_penalty=np.asarray(rep, np.float32),
            presence_penalty=np.asarray(pres, np.float32),
            frequency_penalty=np.asarray(freq, np.float32),
            bias_ids=_pad_ids(bias_ids, nb),
            bias_values=bias_val_arr,
            banned_ids=_pad_ids(banned),
            allowed_ids=_pad_ids(allowed),
            has_allowed=np.asarray(has_allowed, bool),
            seed=np.asarray(seeds, np.uint64).astype(np.uint32),
        )
        stop_rules = StopRules(
            max_tokens=np.asarray(max_t, np.int32),
            min_tokens=np.asarray(min_t, np.int32),
            stop_token_ids=_pad_ids(stops),
            stop_sequences=stop_seqs,
            guard_period=np.asarray(guard_period, np.int32),
            guard_repeats=np.asarray(guard_repeats, np.int32),
            stop=stop_strs,
        )
        output = OutputOptions(
            logprobs=np.asarray(n_logprobs, np.int32),
            top_logprobs_width=int(np.max(n_logprobs)),
            include_stop_str_in_output=tuple(bool(x) for x in include),
        )
        host = cls(
            knobs=knobs,
            stops=stop_rules,
            output=output,
            constraints=constrained,
            vocab_size=None if vocab_size is None else int(vocab_size),
            broadcasts=broadcasts,
        )
        return host._with_arrays(jax.device_put(host.device_only()))

    def broadcast_to(self, batch_size: int, what: str = "prompts") -> SamplingParams:
        """These params for a batch of `batch_size` rows: themselves when they have that
        many rows; their one row repeated when made without a batch_size (`create()`);
        otherwise ValueError ("params has batch_size 2 but there are 3 prompts", `what`
        naming the batch's items). Traceable: under `jit` the rows repeat on device."""
        if self.batch_size == batch_size:
            return self
        if not self.broadcasts:
            raise ValueError(
                f"params has batch_size {self.batch_size} but there are {batch_size} {what} "
                "(SamplingParams.create without batch_size makes one row for any batch)"
            )
        rows = [0] * batch_size
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(self)):
            arrays = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (batch_size, *x.shape[1:])), self.device_only()
            )
            return self._rows_metadata(arrays, rows)
        return self.take(rows)

    def check_vocab(self, vocab_size: int) -> None:
        """Host-side check that every token id in these params lies in [0, vocab_size)."""
        for name, arr in (
            ("logit_bias", self.bias_ids),
            ("banned_token_ids", self.banned_ids),
            ("allowed_token_ids", self.allowed_ids),
            ("stop_token_ids", self.stop_token_ids),
        ):
            rows = [[int(t) for t in r if t >= 0] for r in np.asarray(arr)]
            _check_ids(name, rows, vocab_size)
        seqs = np.asarray(self.stop_sequences).reshape(self.batch_size, -1)
        _check_ids("stop_sequences", [[int(t) for t in r if t >= 0] for r in seqs], vocab_size)

    def device_only(self) -> SamplingParams:
        """The same params without host-side metadata, for passing into jit-compiled code."""
        return self.replace(
            stop=(), include_stop_str_in_output=(), constraints=(), vocab_size=None,
            broadcasts=False,
        )  # fmt: skip

    # ------------------------------------------------------------------ rows and widths

    def widths(self) -> Widths:
        """The list widths these params need: each list's longest row, bucketed as `create`
        buckets it (a host-side read of the arrays)."""
        host = jax.device_get(self.device_only())

        def width(ids: np.ndarray, minimum: int = MIN_LIST_WIDTH) -> int:
            return bucket_width(int(np.max((ids >= 0).sum(axis=-1), initial=0)), minimum)

        used = host.stop_sequences >= 0  # [B, Q, L]
        encoded = [s.encode("utf-8") for row in self.stop for s in row]
        return Widths(
            bias=width(host.bias_ids),
            banned=width(host.banned_ids),
            allowed=width(host.allowed_ids),
            stop_ids=width(host.stop_token_ids),
            sequences=width(used.any(axis=2), 1),
            sequence_len=bucket_width(int(used.sum(axis=2).max(initial=0)), 1),
            stop_strings=(bucket_width(max(len(r) for r in self.stop), 4) if encoded else 0),
            stop_len=bucket_width(max((len(b) for b in encoded), default=1), 16),
            top_logprobs=self.top_logprobs_width,
        )

    def widen(self, widths: Widths) -> SamplingParams:
        """The same rows with every per-row list at `widths` (entries kept, -1 padding added
        or removed) and the top logprobs `widths.top_logprobs` wide (at least every row's
        `logprobs`), so that params of different requests stack into one batch."""
        return self._with_arrays(jax.device_put(self._widened_host(widths)))

    def _widened_host(self, widths: Widths) -> SamplingParams:
        """`widen`'s arrays on the host (numpy leaves, no metadata)."""
        host = jax.device_get(self.device_only())
        b = self.batch_size
        bias_keep = host.bias_ids >= 0  # ids and values move together
        asked = np.asarray(host.logprobs)
        if np.any(asked > widths.top_logprobs):
            r = int(np.flatnonzero(asked > widths.top_logprobs)[0])
            raise ValueError(
                f"row {r} asks for logprobs = {asked[r]}, over width {widths.top_logprobs}"
            )

        def fit(arr: np.ndarray, keep: np.ndarray, width: int, fill: Any) -> np.ndarray:
            out = np.full((b, width), fill, arr.dtype)
            for r in range(b):
                vals = arr[r][keep[r]]
                if len(vals) > width:
                    raise ValueError(f"row {r} has {len(vals)} list entries, over width {width}")
                out[r, : len(vals)] = vals
            return out

        seqs = np.full((b, widths.sequences, widths.sequence_len), -1, np.int32)
        for r in range(b):
            rows = [s[s >= 0] for s in host.stop_sequences[r] if np.any(s >= 0)]
            for j, s in enumerate(rows):
                seqs[r, j, widths.sequence_len - len(s) :] = s
        return host.replace(
            bias_ids=fit(host.bias_ids, bias_keep, widths.bias, -1),
            bias_values=fit(host.bias_values, bias_keep, widths.bias, 0),
            banned_ids=fit(host.banned_ids, host.banned_ids >= 0, widths.banned, -1),
            allowed_ids=fit(host.allowed_ids, host.allowed_ids >= 0, widths.allowed, -1),
            stop_token_ids=fit(host.stop_token_ids, host.stop_token_ids >= 0, widths.stop_ids, -1),
            stop_sequences=seqs,
            top_logprobs_width=widths.top_logprobs,
        )

    @classmethod
    def concat(
        cls, parts: Sequence[SamplingParams], widths: Widths | None = None
    ) -> SamplingParams:
        """Stack the rows of several params, each widened to the widest lists of all (and
        at least `widths`)."""
        if widths is None:
            widths = functools.reduce(Widths.union, (p.widths() for p in parts))
        wide = [p._widened_host(widths) for p in parts]
        arrays = jax.device_put(jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *wide))
        has_stop = any(p.stop for p in parts)
        vocab = {p.vocab_size for p in parts}
        return arrays.replace(
            stop=sum((p.stop or ((),) * p.batch_size for p in parts), ()) if has_stop else (),
            include_stop_str_in_output=(
                sum((p.include_stop_str_in_output or (False,) * p.batch_size for p in parts), ())
                if any(p.include_stop_str_in_output for p in parts)
                else ()
            ),
            constraints=(
                sum((p.constraints or (None,) * p.batch_size for p in parts), ())
                if any(p.constraints for p in parts)
                else ()
            ),
            vocab_size=vocab.pop() if len(vocab) == 1 else None,
        )

    def samples(self, n: int) -> SamplingParams:
        """Each row repeated `n` times (prompt-major), sample i > 0 with a seed derived from
        the row's own (`child_seed`), as `generate(..., n=n)` draws them."""
        if n == 1:
            return self
        seeds = np.asarray(self.seed)
        rows = [r for r in range(self.batch_size) for _ in range(n)]
        child = [child_seed(int(seeds[r]), i % n) for i, r in enumerate(rows)]
        return self.take(rows).replace(seed=jax.device_put(np.asarray(child, np.uint32)))

    def with_stop_token_ids(self, extra: Sequence[int]) -> SamplingParams:
        """Every row's stop token ids plus `extra` (the model's EOS ids), kept bucketed."""
        old = np.asarray(self.stop_token_ids)
        rows = [[int(t) for t in r if t >= 0] for r in old]
        rows = [r + [int(e) for e in extra if e not in r] for r in rows]
        width = bucket_width(max(old.shape[1], max(len(r) for r in rows)))
        return self.replace(stop_token_ids=jax.device_put(_pad_ids(rows, width)))

    def _with_arrays(self, arrays: SamplingParams) -> SamplingParams:
        """`arrays`' leaves with this params' host-side metadata."""
        return arrays.replace(
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            constraints=self.constraints,
            vocab_size=self.vocab_size,
            broadcasts=self.broadcasts,
        )

    def take(self, rows: Any) -> SamplingParams:
        """Select (or repeat) rows: `params.take([0, 0, 1])` (on the host: compiles nothing).
        The result has exactly those rows (it does not broadcast)."""
        idx = np.asarray(rows, np.int64)
        if not self.broadcasts and np.array_equal(idx, np.arange(self.batch_size)):
            return self  # every row in order (a request's one row): nothing to move
        host = jax.device_get(self.device_only())
        # device_put, not jnp.asarray: a transfer, where jnp.asarray compiles a copy program;
        # one call for every leaf
        arrays = jax.device_put(jax.tree.map(lambda x: x[idx], host))
        return self._rows_metadata(arrays, idx)

    def with_dummy_rows(self, rows: int) -> SamplingParams:
        """These rows, then dummy rows up to `rows` (a batch padded to its row bucket, or to
        a multiple of a mesh's data axis): each a copy of row 0 with `max_tokens = 1`,
        `min_tokens = 0`, no stop strings and no constraint, so it finishes on its first
        token and never holds the loop open. On the host, one transfer (compiles nothing)."""
        batch = self.batch_size
        if rows <= batch:
            return self
        idx = np.asarray(list(range(batch)) + [0] * (rows - batch), np.int64)
        host = jax.tree.map(lambda x: x[idx], jax.device_get(self.device_only()))
        dummy = np.arange(rows) >= batch
        host = host.replace(
            max_tokens=np.where(dummy, 1, host.max_tokens).astype(np.int32),
            min_tokens=np.where(dummy, 0, host.min_tokens).astype(np.int32),
        )
        padded = self._rows_metadata(jax.device_put(host), idx)
        pad = rows - batch
        return padded.replace(
            stop=self.stop + ((),) * pad if self.stop else (),
            constraints=self.constraints + (None,) * pad if self.constraints else (),
        )

    def _rows_metadata(self, arrays: SamplingParams, idx: Any) -> SamplingParams:
        """`arrays` (rows `idx` of these params' leaves) with the same rows' host metadata."""
        return arrays.replace(
            stop=tuple(self.stop[i] for i in idx) if self.stop else (),
            include_stop_str_in_output=tuple(self.include_stop_str_in_output[i] for i in idx)
            if self.include_stop_str_in_output
            else (),
            constraints=tuple(self.constraints[i] for i in idx) if self.constraints else (),
            vocab_size=self.vocab_size,
            broadcasts=False,
        )

    @classmethod
    def from_model(
        cls, model: Any, batch_size: int | None = None, **overrides: Any
    ) -> SamplingParams:
        """`create` with the checkpoint's recommended settings (`generation_config.json`, see
        `generation_defaults`) wherever `overrides` set none (without `batch_size`: one row
        for any batch, as `create`)."""
        return cls.create(batch_size, **{**generation_defaults(model), **overrides})


def _part_field(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"`{part}.{name}`")


# Every field of a part, as an attribute of the params (`params.seed` is `params.knobs.seed`).
for _name, _part in PARTS.items():
    setattr(SamplingParams, _name, _part_field(_part, _name))


DEFAULT_MAX_TOKENS = 16  # create's max_tokens when neither it nor max_new_tokens is given
# Other names users type for a `create` argument (transformers' `max_new_tokens`).
ALIASES = {"max_new_tokens": "max_tokens"}


def canonical_knobs(knobs: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """`create` keyword arguments with every alias under its own name (`ALIASES`), None
    values of an alias dropped; so dicts of settings merge key by key. Raises ValueError
    (prefixed by `where`) when a dict gives a name and its alias both."""
    out = {k: v for k, v in knobs.items() if k not in ALIASES}
    for alias, name in ALIASES.items():
        value = knobs.get(alias)
        if value is None:
            continue
        if out.get(name) is not None:
            raise ValueError(
                f"{where}{name} = {out[name]!r} and its alias {alias} = {value!r} are both "
                "given: give one of them"
            )
        out[name] = value
    return out


def generation_defaults(model: Any) -> dict[str, Any]:
    """The sampling settings the checkpoint's `generation_config.json` recommends, as
    `SamplingParams.create` arguments (`logitloop.models.generation_config`). `model` is a
    loaded model or its checkpoint folder (a path). Empty for a model without a folder.

    Raises ValueError naming the file for a value `SamplingParams.create` refuses.
    """
    path, out = read_generation_config(model)
    try:
        SamplingParams.create(1, **out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return out
