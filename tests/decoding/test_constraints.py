"""Structured output: json_schema, regex and choice constraints in the decode loop.

The packed automata are checked against two independent references: outlines-core's own
`Index` (allowed tokens and transitions state by state) and, for a literal, plain byte
prefixes of the target. Documents sampled at temperature 1 from the shipped model are
validated with `jsonschema` / `re.fullmatch`; the distribution at a fixed prefix is compared
with a float64 NumPy reference (chi-square). The loop tests use a weightless model whose
logits are wider than the tokenizer (`noise_model`).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import outlines_core
import pytest
from flax import struct
from scipy import stats

import logitloop as ll
from logitloop.decoding.sampling import constraints

from .noise_model import EXTRA, noise_model, shipped_tokenizer

SCHEMAS = {
    "bounded_integer": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 3, "maximum": 20},
        },
        "required": ["name", "n"],
    },
    "enum_array": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "anyof": {
        "anyOf": [
            {"type": "boolean"},
            {
                "type": "object",
                "properties": {
                    "a": {
                        "type": "array",
                        "items": {"type": "integer", "exclusiveMinimum": -1, "maximum": 9},
                        "minItems": 1,
                        "maxItems": 2,
                    }
                },
                "required": ["a"],
            },
        ]
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 5},
                        "maxItems": 2,
                    },
                },
                "required": ["id", "tags"],
            }
        },
        "required": ["user"],
    },
}
REGEXES = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "sentence": r"(yes|no), because [a-z]{1,12}\.",
}
ROWS = 64


def _vocab(extra: int = 0) -> constraints.TokenVocabulary:
    tok = shipped_tokenizer()
    return constraints.vocabulary(tok, tok.vocab_size + extra, tok.eos_token_ids)


def _ids(bits: np.ndarray, vocab_size: int) -> set[int]:
    return set(constraints.allowed_tokens(np.asarray(bits), vocab_size).tolist())


# ----------------------------------------------------------------------------- the automata


def test_packed_automaton_matches_outlines_index_along_random_walks():
    vocab = _vocab(EXTRA)
    regex = constraints.parse(SCHEMAS["nested"], None, None, 1)[0].regex
    index = outlines_core.Index(regex, vocab.vocabulary)
    tables, fsm = constraints.tables([constraints.Constraint("regex", regex, regex)], vocab)
    eos = set(vocab.eos_ids)
    rng = np.random.default_rng(0)
    walks = 0
    for _ in range(6):
        state, ours = index.get_initial_state(), jnp.asarray(fsm)
        for _ in range(40):
            want = set(index.get_allowed_tokens(state)) - {vocab.outlines_eos}
            if index.is_final_state(state):
                want |= eos
            bits = constraints.row_bits(tables, ours)
            assert _ids(bits[0], vocab.vocab_size) == want
            moves = sorted(want - eos)
            if not moves:
                break
            tok = int(rng.choice(moves))
            state = index.get_next_state(state, tok)
            ours = constraints.advance(
                tables, ours, bits, jnp.asarray([tok], jnp.int32), jnp.asarray([True])
            )
            walks += 1
    assert walks > 60


def test_byte_level_tokens_follow_byte_prefixes_of_a_literal():
    """A choice of one string: the allowed tokens are exactly those whose bytes extend the
    text so far to a prefix of the string's UTF-8 (halves of a character included), EOS only
    at its end, and no id past the tokenizer."""
    target = "café (ü+1)|x."  # regex metacharacters: a choice is a literal
    vocab = _vocab(EXTRA)
    pieces = shipped_tokenizer().all_token_bytes()
    goal = target.encode("utf-8")
    tables, fsm = constraints.tables(constraints.parse(None, None, [target], 1), vocab)
    fsm = jnp.asarray(fsm)
    done, split_char = b"", False
    while True:
        want = {i for i, b in enumerate(pieces) if b and goal.startswith(done + b)}
        want -= set(vocab.eos_ids)
        if done == goal:
            want |= set(vocab.eos_ids)
        bits = constraints.row_bits(tables, fsm)
        got = _ids(bits[0], vocab.vocab_size)
        assert got == want
        assert bool(constraints.can_only_end(tables, fsm)[0]) == (done == goal)
        if done == goal:
            break
        # The shortest allowed token: walks through split characters where the vocab has them.
        tok = min(want, key=lambda i: (len(pieces[i]), i))
        split_char |= (done + pieces[tok]).decode("utf-8", "ignore").encode() != done + pieces[tok]
        fsm = constraints.advance(tables, fsm, bits, jnp.asarray([tok]), jnp.asarray([True]))
        done += pieces[tok]
    assert split_char  # the walk went through a token holding half of a character


def test_one_table_holds_several_constraints_at_bucketed_shapes():
    vocab = _vocab()
    rows = constraints.parse(
        [SCHEMAS["enum_array"], None, None], [None, "a|b", None], [None, None, ["x", "yy"]], 3
    )
    tables, fsm = constraints.tables(rows, vocab)
    assert fsm[2] > fsm[1] > fsm[0] >= 0  # packed one after another
    for size in (tables.bits.shape[0], tables.targets.shape[0]):
        assert size & (size - 1) == 0
    assert tables.bits.shape[1] == -(-vocab.vocab_size // 32)
    # The same constraint in two rows shares one automaton.
    _, twice = constraints.tables(rows[:1] + rows[:1], vocab)
    assert twice[0] == twice[1]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": [None, "(ab"]}, r"regex\[1\] is not a supported regex"),
        ({"regex": [None, "^a"]}, r"regex\[1\]"),
        ({"json_schema": [None, {"not": {"type": "string"}}]}, r"json_schema\[1\] uses 'not'"),
        ({"json_schema": [None, '{"type": "integer"']}, r"json_schema\[1\] is not valid JSON"),
        ({"json_schema": [None, "[" * 100_000]}, r"json_schema\[1\] is JSON nested too deep"),
        ({"json_schema": [None, {"type": "number", "minimum": 0}]}, r"json_schema\[1\].*'minimum'"),
        (
            {"json_schema": [None, {"type": "integer", "minimum": 0}]},
            r"json_schema\[1\]: integer bounds are supported only as a finite range",
        ),
        (
            {"json_schema": [None, {"type": "array", "uniqueItems": True}]},
            r"json_schema\[1\] uses 'uniqueItems'",
        ),
        (
            {"json_schema": [None, {"type": "integer", "minimum": 5, "maximum": 4}]},
            r"json_schema\[1\]: no integer",
        ),
        ({"choice": [None, []]}, r"choice\[1\] must be a non-empty list"),
        ({"choice": [None, ["a", ""]]}, r"choice\[1\]\[1\]"),
        ({"choice": ["a"], "regex": "b"}, r"row 0 has both regex and choice"),
        ({"regex": ["a"]}, r"regex has 1 per-row entries but batch_size is 2"),
    ],
)
def test_bad_constraints_raise_naming_the_row(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ll.SamplingParams.create(2, **kwargs)


def test_a_constraint_the_vocabulary_cannot_spell_fails_before_decoding():
    tok = shipped_tokenizer()
    pieces = [b if b != b"\x07" else b"" for b in tok.all_token_bytes()]  # no token has \x07
    vocab = constraints.TokenVocabulary(pieces, tok.eos_token_ids, tok.vocab_size)
    rows = constraints.parse(None, [None, "ok\\x07"], None, 2)
    with pytest.raises(ValueError, match=r"row 1: no token sequence of this vocabulary"):
        constraints.tables(rows, vocab)


def test_sample_refuses_constrained_params_without_their_masks():
    params = ll.SamplingParams.create(1, regex="a")
    for fn in (ll.sample, ll.sampling_distribution):
        with pytest.raises(ValueError, match="constraints, which act through allowed_bits"):
            fn(jnp.zeros((1, 64)), params, jnp.zeros(1, jnp.int32))


def test_constraints_need_a_tokenizer():
    model = noise_model()
    bare = ll.FunctionModel(
        apply_fn=model.apply_fn,
        params=model.params,
        init_cache=model.init_cache,
        vocab_size=model.vocab_size,
        max_length=model.max_length,
    )
    params = ll.SamplingParams.create(1, regex="a")
    with pytest.raises(ValueError, match="need a model that carries a tokenizer"):
        ll.generate(bare, [[1, 2]], params)


# ----------------------------------------------------------------------------- exactness


def test_distribution_is_the_processed_one_restricted_to_the_allowed_tokens():
    """At a fixed prefix (the regex's start state), `sampling_distribution` and the loop's
    first tokens equal softmax(logits / T) over the allowed tokens' top-k, float64."""
    vocab = _vocab(EXTRA)
    regex = r"[a-z ]{1,6}[0-9]"
    index = outlines_core.Index(regex, vocab.vocabulary)
    allowed = np.asarray(sorted(index.get_allowed_tokens(index.get_initial_state())))
    assert 50 < len(allowed) < vocab.vocab_size // 2
    model = noise_model()
    temperature, top_k = 0.7, 40
    logits, _ = model.apply_fn(model.params, jnp.asarray([[5]]), jnp.asarray([[0]]), None)
    logits = np.asarray(logits)
    z = np.full(vocab.vocab_size, -np.inf)
    z[allowed] = logits[0, allowed].astype(np.float64) / temperature
    kth = np.sort(z)[-top_k]
    z[z < kth] = -np.inf
    want = np.exp(z - z.max())
    want /= want.sum()

    rows = 2000
    params = ll.SamplingParams.create(
        rows,
        temperature=temperature,
        top_k=top_k,
        seed=np.arange(rows),
        max_tokens=1,
        regex=regex,
    )
    tables, fsm = constraints.tables(params.constraints[:1], vocab)
    bits = constraints.row_bits(tables, jnp.asarray(fsm))
    got = ll.sampling_distribution(
        jnp.asarray(logits), params.take([0]), jnp.zeros(1, jnp.int32), allowed_bits=bits
    )
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-6)

    result = ll.generate(model, [[5]] * rows, params)  # every row: token 5 at position 0
    counts = np.bincount([t[0] for t in result.token_ids], minlength=vocab.vocab_size)
    keep = want > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], want[keep] * rows).pvalue > 1e-3


# ----------------------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def sampled():  # about a minute on two cores: the tests that use it are marked slow
    """ROWS rows per constraint at temperature 1, every constraint in one batch."""
    names = list(SCHEMAS) + list(REGEXES)
    schemas = [SCHEMAS.get(n) for n in names for _ in range(ROWS)]
    regexes = [REGEXES.get(n) for n in names for _ in range(ROWS)]
    batch = len(schemas)
    params = ll.SamplingParams.create(
        batch,
        temperature=1.0,
        seed=np.arange(batch),
        max_tokens=64,
        json_schema=schemas,
        regex=regexes,
    )
    model = ll.load_pretrained()
    result = ll.generate(model, ["The answer:"] * batch, params)
    return {
        n: [(result.text[i], result.finish_reason[i]) for i in range(k * ROWS, (k + 1) * ROWS)]
        for k, n in enumerate(names)
    }


def _matches(name: str, text: str) -> bool:
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])  # raises when it does not
        return True
    return re.fullmatch(REGEXES[name], text) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS) + list(REGEXES))
def test_sampled_documents_are_valid_and_mostly_complete(sampled, name):
    """Every row that stopped holds a valid document (jsonschema / re.fullmatch), and at
    least 90% of the rows stopped before max_tokens."""
    stopped = [text for text, reason in sampled[name] if reason == "stop"]
    assert len(stopped) >= 0.9 * ROWS
    for text in stopped:
        assert _matches(name, text), text
    assert len(set(stopped)) > 4  # sampled, not one forced document


# ----------------------------------------------------------------------------- the loop


def _mixed(batch_seed: int = 0, max_tokens=40, choice=("qzx", "xqz")):
    return ll.SamplingParams.create(
        4,
        temperature=1.0,
        seed=[batch_seed, batch_seed + 1, batch_seed + 2, batch_seed + 3],
        max_tokens=max_tokens,
        json_schema=[None, SCHEMAS["enum_array"], None, None],
        regex=[None, None, r"[0-9]{2,3}x", None],
        choice=[None, None, None, list(choice)],  # 62 states in all: every subset
    )  # of these rows packs into the smallest bucket, so the tests below share programs


def _valid(row: int, text: str) -> bool:
    if row == 1:
        jsonschema.validate(json.loads(text), SCHEMAS["enum_array"])
        return True
    if row == 2:
        return re.fullmatch(r"[0-9]{2,3}x", text) is not None
    return text in ("qzx", "xqz")


def test_generate_masks_ids_past_the_tokenizer_and_ends_complete_documents():
    model = noise_model()
    vocab_size = shipped_tokenizer().vocab_size
    result = ll.generate(model, [[5, 6]] * 4, _mixed())
    # Unconstrained: the wide logits' extra ids win; constrained rows never see them.
    assert max(result.token_ids[0]) >= vocab_size
    for row in (1, 2, 3):
        assert max(result.token_ids[row]) < vocab_size
        assert result.finish_reason[row] == "stop"
        assert _valid(row, result.text[row])
    # A document cut by max_tokens first is "length"; one complete at max_tokens is "stop".
    # Three control bytes: one token each (no merges hold them), so exactly three tokens.
    for most, reason in ((2, "length"), (3, "stop")):
        short = ll.generate(model, [[5, 6]] * 4, _mixed(0, [40, 1, 1, most], ["\x01\x02\x03"]))
        assert short.finish_reason[1:] == ["length", "length", reason]
        assert short.num_tokens[3] == most


PROMPTS = [[5, 6], [7], [8, 9, 10], [11]]


def test_stream_and_n_agree_with_generate():
    model = noise_model()
    params = _mixed(10)
    want = ll.generate(model, PROMPTS, params)
    text = [""] * 4
    reasons = [None] * 4
    for ev in ll.stream(model, PROMPTS, params, chunk_steps=3):
        text[ev.row] += ev.text
        reasons[ev.row] = ev.finish_reason or reasons[ev.row]
    assert text == want.text and reasons == want.finish_reason
    twice = ll.generate(model, PROMPTS[2:], params.take([2, 3]), n=2)  # 4 rows again
    for row in (2, 3):
        assert twice.token_ids[2 * (row - 2)] == want.token_ids[row]  # sample 0: the seed
        assert _valid(row, twice.text[2 * (row - 2) + 1])
        assert twice.token_ids[2 * (row - 2) + 1] != want.token_ids[row] or row == 3


def test_generate_many_refills_slots_with_the_rows_automaton_state():
    """Three slots for four requests (and three more): constrained requests enter slots that
    other rows left mid-document, and each gets `generate`'s tokens for it alone."""
    model = noise_model()
    params = _mixed(10)
    want = ll.generate(model, PROMPTS, params)
    requests = [ll.Request(p, params.take([r])) for r, p in enumerate(PROMPTS)]
    requests += requests[1:]
    many = ll.generate_many(model, requests[::-1], slots=4, chunk_steps=2, max_tokens_bound=40)
    got = [m.token_ids[0] for m in many[::-1]]
    assert got == want.token_ids + want.token_ids[1:]


def test_a_new_constraint_of_the_same_bucket_compiles_nothing(compile_counter):
    model = noise_model()
    ll.generate(model, [[5]] * 4, _mixed(20))
    schema = {**SCHEMAS["enum_array"], "items": {"enum": ["blue", "red", "green"]}}
    other = ll.SamplingParams.create(
        4,
        temperature=1.0,
        seed=[1, 2, 3, 4],
        max_tokens=40,
        json_schema=[None, schema, None, None],
        regex=[None, None, r"[0-9]{2,3}y", None],
        choice=[None, None, None, ["zzz"]],
    )
    vocab = _vocab(EXTRA)
    old, _ = constraints.tables(_mixed(20).constraints, vocab)
    new, _ = constraints.tables(other.constraints, vocab)
    assert old.bits.shape == new.bits.shape and old.targets.shape == new.targets.shape
    with compile_counter as c:
        result = ll.generate(model, [[5]] * 4, other)
    assert c.count == 0
    assert re.fullmatch("[0-9]{2,3}y", result.text[2])
    assert result.text[3] == "zzz"
    jsonschema.validate(json.loads(result.text[1]), schema)


@struct.dataclass
class BanTokens:
    """A processor: each row's banned tokens ([B, V] bool) to -inf, after the constraint."""

    banned: jax.Array  # [B, V] bool

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size,), jnp.int32)

    def apply(self, state, logits, step):
        return jnp.where(self.banned, -jnp.inf, logits)

    def update(self, state, tokens, step):
        return state


@pytest.mark.slow
def test_processors_compose_with_constraints():
    """The constraint masks in step 1, a processor then bans every token starting with "y":
    a choice of "yes" and "no" can only give "no" in the rows it bans them in."""
    model = noise_model()
    pieces = shipped_tokenizer().all_token_bytes()
    y = np.zeros(model.vocab_size, bool)
    y[[i for i, b in enumerate(pieces) if b.startswith(b"y")]] = True
    banned = np.zeros((8, model.vocab_size), bool)
    banned[:4] = y
    params = ll.SamplingParams.create(
        8, temperature=1.0, seed=np.arange(8), max_tokens=8, choice=["yes", "no"]
    )
    result = ll.generate(model, [[5]] * 8, params, processors=[BanTokens(jnp.asarray(banned))])
    assert result.text[:4] == ["no"] * 4
    assert set(result.text[4:]) <= {"yes", "no"} and "yes" in result.text[4:]
    assert result.finish_reason == ["stop"] * 8
