"""Structured output: per-row token automata (JSON schema, regex, choice), advanced on device.

A constraint is a regular language over bytes. `outlines-core` compiles it (a JSON schema
through `json_schema.build_regex_from_schema`) against the tokenizer's vocabulary into a
token-level automaton (`Index`): in each state, the tokens that keep the text a prefix of
some accepted document, and the state each one leads to. Tokens are bytes (byte-level BPE
pieces map back through GPT-2's byte table, `Tokenizer.token_bytes`), so a token holding
half of a multi-byte character is allowed exactly where those bytes fit. Ids past the
tokenizer's vocabulary (a model whose logits are wider) and special tokens are never
allowed, except the model's EOS ids, which are allowed exactly in accepting states.

The automata of one batch are packed into one set of device tables (`Automata`), with every
row's state one int32 in the loop state (`DecodeState.fsm`, -1 = unconstrained):

    bits     [S, W] u32   allowed-token bitmask of each state, W = ceil(V / 32):
                          token v is allowed in state s iff bit v % 32 of bits[s, v // 32]
    start    [S]    i32   where state s's outgoing edges begin in `targets`
    targets  [E]    i32   next state of each allowed token, edges of a state in token order
    final    [S]    bool  the state allows nothing but EOS: the row's document is complete

The next state after token v in state s is `targets[start[s] + rank]`, where rank is the
number of allowed tokens below v: the popcount of the state's bitmask below bit v. So the
tables take S * V / 8 bytes for the masks plus 4 bytes per edge, not the S * V * 4 bytes of a
dense transition table (a 400-state JSON schema over a 32k vocabulary: 1.6 MB against 52 MB),
and one step costs one row gather of the bitmask, used both for the mask and for the rank.

Shapes are bucketed (S and E to powers of two), so a new constraint whose automaton fits the
bucket compiles nothing; several constraints of a batch share the tables, each row starting
at its automaton's initial state. Compiled automata are cached per (regex, tokenizer).

JSON schemas are checked against the subset whose translation is exact
(`schema_subset.py`: an allow-list of keywords and combinations; integer bounds with a finite
range of at most `MAX_INTEGER_RANGE` values are honoured as an `enum`); anything else is
refused with a ValueError naming its place, so an accepted schema's documents validate.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
from flax import struct
from outlines_core.json_schema import build_regex_from_schema

from logitloop.decoding.sampling.checks import bucket_width
from logitloop.decoding.sampling.regex_errors import explain
from logitloop.decoding.sampling.schema_subset import MAX_INTEGER_RANGE as MAX_INTEGER_RANGE
from logitloop.decoding.sampling.schema_subset import checked_schema

# The tables' smallest bucket (powers of two above): most small schemas, regexes and choices
# fit it, so a new one compiles nothing ("What compiles", docs/performance.md). A step reads
# one row of `bits` and a few `targets` per row whatever the tables' size; the cost is memory
# (states x V/32 words: 4 MiB at a 128k vocabulary).
MIN_STATES = 256
MIN_EDGES = 16384
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One row's constraint: what the user gave (`kind`, `source`) and the regex it is."""

    kind: str  # "json_schema", "regex" or "choice"
    source: str  # the schema as JSON, the regex, or the choices as a JSON list
    regex: str  # the byte language the automaton accepts (full match)


# ----------------------------------------------------------------------------- from the user


def _escape(text: str) -> str:
    """A literal for outlines-core's regex syntax (Rust `regex`)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _schema_constraint(value: Any, where: str) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"{where} is JSON nested too deep to read") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"{where} must be a JSON schema (a dict or JSON text), got {value!r}")
    schema = checked_schema(value, where)
    try:  # property order is document order: the JSON keeps the schema's own
        regex = build_regex_from_schema(json.dumps(schema))
    except (ValueError, TypeError) as e:
        reason = str(e).splitlines()[0]
        raise ValueError(f"{where} is not a supported JSON schema: {reason}") from None
    return Constraint("json_schema", json.dumps(value), regex)


def _regex_constraint(value: Any, where: str) -> Constraint:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty regex string, got {value!r}")
    return Constraint("regex", value, value)


def _choice_constraint(value: Any, where: str) -> Constraint:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where} must be a non-empty list of strings, got {value!r}")
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c:
            raise ValueError(f"{where}[{i}] = {c!r}: each choice must be a non-empty string")
    return Constraint("choice", json.dumps(list(value)), "|".join(_escape(c) for c in value))


def _rows(name: str, value: Any, batch: int, one_row) -> list[Any]:
    """One value for every row, or one value (or None) per row (`one_row(v)`: a row's form)."""
    if value is None:
        return [None] * batch
    if one_row(value):
        return [value] * batch
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a constraint or one (or None) per row, got {value!r}")
    if len(value) != batch:
        raise ValueError(f"{name} has {len(value)} per-row entries but batch_size is {batch}")
    return list(value)


def parse(json_schema: Any, regex: Any, choice: Any, batch: int) -> tuple[Constraint | None, ...]:
    """`SamplingParams.create`'s constraint arguments as one `Constraint` (or None) per row.

    Each takes one value for every row or a list with one value (or None) per row:
    `json_schema` a dict or JSON string, `regex` a string, `choice` a list of strings (per
    row: a list of such lists). A row has at most one constraint. Every regex is compiled
    once here against a vocabulary of all 256 bytes, so a bad one fails before any model is
    involved.
    """
    schemas = _rows("json_schema", json_schema, batch, lambda v: isinstance(v, (dict, str)))
    regexes = _rows("regex", regex, batch, lambda v: isinstance(v, str))
    choices = _rows(
        "choice",
        choice,
        batch,
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(c, str) for c in v),
    )
    out: list[Constraint | None] = []
    for row in range(batch):
        given = [
            (name, v)
            for name, v in (
                ("json_schema", schemas[row]),
                ("regex", regexes[row]),
                ("choice", choices[row]),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"row {row} has both {given[0][0]} and {given[1][0]}: at most one constraint "
                "per row"
            )
        if not given:
            out.append(None)
            continue
        name, v = given[0]
        where = name if batch == 1 else f"{name}[{row}]"  # one row: its caller names it
        make = {
            "json_schema": _schema_constraint,
            "regex": _regex_constraint,
            "choice": _choice_constraint,
        }[name]
        c = make(v, where)
        try:
            _byte_index(c.regex)
        except ValueError as e:
            reason = explain(c.regex, e) if c.kind == "regex" else _reason(e)
            raise ValueError(f"{where} is not a supported regex: {reason}") from None
        out.append(c)
    return tuple(out) if any(c is not None for c in out) else ()


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0]


@functools.lru_cache(maxsize=256)
def _byte_index(regex: str) -> None:
    """Compile `regex` over single bytes (any byte string is reachable): errors are the
    regex's own."""
    outlines_core.Index(regex, _BYTE_VOCABULARY)


_BYTE_VOCABULARY = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


# ----------------------------------------------------------------------------- automata


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: the cache's objects
class HostAutomaton:
    """One compiled constraint in packed form (numpy), states numbered from 0."""

    initial: int
    bits: np.ndarray  # [S, W] u32
    start: np.ndarray  # [S] i32, local edge offsets
    targets: np.ndarray  # [E] i32, local states
    final: np.ndarray  # [S] bool

    @property
    def num_states(self) -> int:
        return self.bits.shape[0]

    @property
    def num_edges(self) -> int:
        return self.targets.shape[0]


@struct.dataclass
class Automata:
    """The packed automata of a batch, on device (see the module docstring)."""

    bits: jax.Array  # [S, W] u32
    start: jax.Array  # [S] i32
    targets: jax.Array  # [E] i32
    final: jax.Array  # [S] bool


class TokenVocabulary:
    """A tokenizer's vocabulary as outlines-core sees it: bytes -> ids, EOS kept apart."""

    def __init__(self, token_bytes: Sequence[bytes], eos_ids: Sequence[int], vocab_size: int):
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer are never allowed
        self.eos_ids = tuple(sorted({int(e) for e in eos_ids if 0 <= e < vocab_size}))
        pieces: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes[:vocab_size]):
            if b and i not in self.eos_ids:  # special tokens have no bytes: never allowed
                pieces.setdefault(bytes(b), []).append(i)
        # Without an EOS id the outlines vocabulary still needs one: an id past V, dropped.
        self.outlines_eos = self.eos_ids[0] if self.eos_ids else vocab_size
        self.vocabulary = outlines_core.Vocabulary(self.outlines_eos, pieces)
        self.cache: dict[str, HostAutomaton] = {}


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> TokenVocabulary:
    """The tokenizer's `TokenVocabulary` for logits `vocab_size` wide (cached per tokenizer)."""
    per_tok = _VOCABULARIES.setdefault(tokenizer, {})
    key = (vocab_size, tuple(sorted(eos_ids)))
    if key not in per_tok:
        per_tok[key] = TokenVocabulary(tokenizer.all_token_bytes(), eos_ids, vocab_size)
    return per_tok[key]


def compile_automaton(regex: str, vocab: TokenVocabulary) -> HostAutomaton:
    """The packed automaton of `regex` over `vocab` (cached); ValueError if the vocabulary
    cannot spell any accepted document."""
    cached = vocab.cache.get(regex)
    if cached is not None:
        return cached
    index = outlines_core.Index(regex, vocab.vocabulary)
    transitions = index.get_transitions()  # {state: {token: next state}}
    finals = set(index.get_final_states())
    names = sorted(set(transitions) | finals | {index.get_initial_state()})
    local = {s: i for i, s in enumerate(names)}
    words = -(-vocab.vocab_size // 32)
    num = len(names)
    bits = np.zeros((num, words), np.uint32)
    start = np.zeros((num,), np.int32)
    final = np.zeros((num,), bool)
    targets = []
    for i, s in enumerate(names):
        edges = {t: local[n] for t, n in transitions.get(s, {}).items() if t != vocab.outlines_eos}
        if s in finals:
            for e in vocab.eos_ids:
                edges[e] = i  # EOS in an accepting state: the row stops on it (a stop id)
        toks = np.fromiter(sorted(edges), np.int64, len(edges))
        start[i] = len(targets)
        targets.extend(edges[t] for t in toks.tolist())
        np.bitwise_or.at(bits[i], toks >> 5, (np.uint32(1) << (toks & 31)).astype(np.uint32))
        final[i] = all(t in vocab.eos_ids for t in edges)
    automaton = HostAutomaton(
        initial=local[index.get_initial_state()],
        bits=bits,
        start=start,
        targets=np.asarray(targets, np.int32),
        final=final,
    )
    vocab.cache[regex] = automaton
    return automaton


def pack(
    automata: Sequence[HostAutomaton], min_states: int = MIN_STATES, min_edges: int = MIN_EDGES
) -> tuple[Automata, list[int]]:
    """One set of device tables for several automata, at bucketed shapes (at least
    `min_states` x `min_edges`); returns them and each automaton's initial state in them.

    Appending automata keeps the earlier ones' offsets, so a long-lived batch can grow its
    tables without touching the states its rows are in.
    """
    states = bucket_width(sum(a.num_states for a in automata), min_states)
    edges = bucket_width(sum(a.num_edges for a in automata), min_edges)
    words = automata[0].bits.shape[1]
    bits = np.zeros((states, words), np.uint32)
    start = np.zeros((states,), np.int32)
    targets = np.zeros((edges,), np.int32)
    final = np.ones((states,), bool)  # padding states are never entered
    initial = []
    s0 = e0 = 0
    for a in automata:
        s1, e1 = s0 + a.num_states, e0 + a.num_edges
        bits[s0:s1] = a.bits
        start[s0:s1] = a.start + e0
        targets[e0:e1] = a.targets + s0
        final[s0:s1] = a.final
        initial.append(s0 + a.initial)
        s0, e0 = s1, e1
    # device_put, not jnp.asarray: a transfer, where jnp.asarray compiles a program per shape
    tables = jax.device_put(Automata(bits=bits, start=start, targets=targets, final=final))
    return tables, initial


def compile_rows(
    constraints: Sequence[Constraint | None], vocab: TokenVocabulary
) -> list[HostAutomaton | None]:
    """Each row's automaton (None for unconstrained rows); ValueError naming the row."""
    out = []
    for row, c in enumerate(constraints):
        if c is None:
            out.append(None)
            continue
        try:
            out.append(compile_automaton(c.regex, vocab))
        except ValueError as e:
            raise ValueError(
                f"row {row}: no token sequence of this vocabulary satisfies its {c.kind} "
                f"({_reason(e)})"
            ) from None
    return out


def refuse_stop_ids(
    constraints: Sequence[Constraint | None], stop_token_ids: np.ndarray, vocab: TokenVocabulary
) -> None:
    """ValueError when a constrained row has a stop token id (`stop_token_ids` [B, Ns], -1
    unused) that its automaton allows in some state: the row would end there, mid-document.
    The model's EOS ids are left out: they are allowed only where the document is complete."""
    for row, a in enumerate(compile_rows(constraints, vocab)):
        if a is None:
            continue
        ids = np.asarray([t for t in stop_token_ids[row] if t >= 0 and t not in vocab.eos_ids])
        if not ids.size:
            continue
        seen = np.bitwise_or.reduce(a.bits, axis=0)  # [S, W] -> [W]: allowed in any state
        hit = ids[((seen[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]
        if hit.size:
            raise ValueError(
                f"row {row}: stop token id {int(hit[0])} is a token its {constraints[row].kind} "
                "can write mid-document; a constrained row ends when its document is complete "
                "(give special tokens as stop ids)"
            )


def tables(
    constraints: Sequence[Constraint | None], vocab: TokenVocabulary
) -> tuple[Automata | None, np.ndarray]:
    """Device tables for a batch's rows and each row's initial state ([B] i32, -1 = none)."""
    compiled = compile_rows(constraints, vocab)
    distinct: dict[int, int] = {}
    for a in compiled:
        if a is not None:
            distinct.setdefault(id(a), len(distinct))
    fsm = np.full((len(constraints),), -1, np.int32)
    if not distinct:
        return None, fsm
    order = {id(a): a for a in compiled if a is not None}
    packed, initial = pack([order[k] for k in distinct])
    for row, a in enumerate(compiled):
        if a is not None:
            fsm[row] = initial[distinct[id(a)]]
    return packed, fsm


# ----------------------------------------------------------------------------- on device


def row_bits(automata: Automata, fsm: jax.Array) -> jax.Array:
    """[B, W] u32 each row's allowed-token bitmask; every bit set for unconstrained rows."""
    words = automata.bits[jnp.maximum(fsm, 0)]  # [B] -> [B, W]
    return jnp.where((fsm >= 0)[:, None], words, jnp.uint32(0xFFFFFFFF))


def advance(
    automata: Automata,
    fsm: jax.Array,  # [B] i32, -1 = unconstrained
    bits: jax.Array,  # [B, W] u32, `row_bits(automata, fsm)`
    tokens: jax.Array,  # [B] i32, drawn from the allowed tokens
    write: jax.Array,  # [B] bool, rows that appended their token
) -> jax.Array:
    """[B] i32 each row's state after its token (unchanged where nothing was written)."""
    word = tokens >> 5
    below = jnp.arange(bits.shape[1])[None, :] < word[:, None]  # [B, W]
    rank = jnp.sum(jax.lax.population_count(jnp.where(below, bits, 0)), axis=1)
    own = jnp.take_along_axis(bits, word[:, None], axis=1)[:, 0]  # [B]
    low = (jnp.uint32(1) << (tokens & 31).astype(jnp.uint32)) - jnp.uint32(1)
    rank = (rank + jax.lax.population_count(own & low)).astype(jnp.int32)
    edge = jnp.minimum(automata.start[jnp.maximum(fsm, 0)] + rank, automata.targets.shape[0] - 1)
    return jnp.where(write & (fsm >= 0), automata.targets[edge], fsm)


def can_only_end(automata: Automata, fsm: jax.Array) -> jax.Array:
    """[B] bool rows whose automaton allows nothing but EOS: their document is complete."""
    return (fsm >= 0) & automata.final[jnp.maximum(fsm, 0)]


def allowed_tokens(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """Host side: the ids a [W] bitmask allows (for inspection and tests)."""
    ids = np.arange(vocab_size)
    return ids[((bits[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]
