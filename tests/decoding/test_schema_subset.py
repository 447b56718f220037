"""Structured output accepts only the JSON Schema subset it translates exactly
(`logitloop.decoding.sampling.schema_subset`): every document its automaton accepts validates
(hypothesis: random schemas of the subset, random walks of their automata, `jsonschema`),
and everything else is refused before any work."""

from __future__ import annotations

import json

import jsonschema
import outlines_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outlines_core.json_schema import build_regex_from_schema

import logitloop as ll
from logitloop.decoding.sampling.schema_subset import checked_schema

BYTES = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})

# ------------------------------------------------------------------ the subset, generated

_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.tuples(st.sampled_from([1, -1]), st.floats(1e-6, 1e6))
    .map(lambda sx: sx[0] * float(f"{sx[1]:.6g}"))
    .filter(lambda x: not x.is_integer()),
    _text,
)
_plain_key = st.text(st.sampled_from("ab_ 1Z"), max_size=3)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(_plain_key, inner, max_size=2),
    max_leaves=4,
)
_name = st.text(st.sampled_from("ab.*(|é$ -"), min_size=1, max_size=4)
_TYPES = ["null", "boolean", "integer", "number", "string"]


@st.composite
def _string(draw):
    node = {"type": "string"}
    kind = draw(st.sampled_from(["plain", "lengths", "format", "pattern"]))
    if kind == "lengths":
        lo = draw(st.integers(0, 3))
        node |= {"minLength": lo, "maxLength": lo + draw(st.integers(0, 3))}
    elif kind == "format":
        node["format"] = draw(st.sampled_from(["date-time", "date", "uuid"]))
    elif kind == "pattern":
        node["pattern"] = draw(st.sampled_from(["[a-z]{1,3}", "^[0-9]+-[A-Z]$", "(ab|é)+"]))
    return node


@st.composite
def _integer(draw):
    node = {"type": "integer"}
    if draw(st.booleans()):
        lo = draw(st.integers(-50, 50))
        node |= {"minimum": lo, "exclusiveMaximum": lo + draw(st.integers(1, 20))}
    return node


_leaf = st.one_of(
    st.sampled_from([{"type": t} for t in _TYPES]),
    _string(),
    _integer(),
    st.lists(_value, min_size=1, max_size=3).map(lambda v: {"enum": v}),
    _value.map(lambda v: {"const": v}),
    st.lists(st.sampled_from(_TYPES), min_size=1, max_size=3, unique=True).map(
        lambda t: {"type": t}
    ),
    st.tuples(st.sampled_from(_TYPES), st.lists(_scalar, min_size=1, max_size=4)).map(
        lambda tv: {"type": tv[0], "enum": tv[1]}  # values of other types are dropped
    ),
    st.sampled_from(
        [
            {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            {"oneOf": [{"enum": [1, 2]}, {"const": 3}, {"type": "string"}]},
        ]
    ),
)


def _composite(inner):
    @st.composite
    def obj(draw):
        props = draw(st.dictionaries(_name, inner, max_size=3))
        node = {"type": "object", "properties": props}
        names = st.sampled_from(sorted(props)) if props else st.nothing()
        node["required"] = draw(st.lists(names, unique=True))
        if draw(st.booleans()):
            node["additionalProperties"] = False
        return node

    @st.composite
    def arr(draw):
        node = {"type": "array", "items": draw(inner)}
        if draw(st.booleans()):
            lo = draw(st.integers(0, 2))
            node |= {"minItems": lo, "maxItems": lo + draw(st.integers(0, 2))}
        return node

    any_of = st.lists(inner, min_size=1, max_size=3).map(lambda b: {"anyOf": b})
    all_of = inner.map(lambda s: {"allOf": [s]})
    return st.one_of(obj(), arr(), any_of, all_of)


SCHEMAS = st.recursive(_leaf, _composite, max_leaves=6)


def _documents(regex: str, draw, count: int) -> list[str]:
    """`count` random documents the automaton of `regex` accepts (random walks, steered to
    an accepting state once long)."""
    index = outlines_core.Index(regex, BYTES)
    edges = {s: {b: t for b, t in e.items() if b < 256} for s, e in index.get_transitions().items()}
    finals = set(index.get_final_states())
    distance = {s: 0 for s in finals}  # steps to an accepting state
    changed = True
    while changed:
        changed = False
        for s, e in edges.items():
            best = min((distance[t] + 1 for t in e.values() if t in distance), default=None)
            if best is not None and best < distance.get(s, 1 << 30):
                distance[s], changed = best, True
    out = []
    for _ in range(count):
        state, text = index.get_initial_state(), bytearray()
        while True:
            if state in finals and (not edges.get(state) or draw(st.integers(0, 3)) == 0):
                break
            options = sorted(edges[state].items())
            if len(text) > 40:  # long enough: head for the nearest end
                options = [min(options, key=lambda bt: distance.get(bt[1], 1 << 30))]
            byte, state = draw(st.sampled_from(options))
            text.append(byte)
        out.append(text.decode("utf-8"))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, data=st.data())
def test_every_document_of_an_accepted_schema_validates(schema, data):
    jsonschema.Draft202012Validator.check_schema(schema)
    try:
        checked = checked_schema(schema, "json_schema")
    except ValueError:
        return  # refused (a typed enum with no value of its type): also keeps the promise
    regex = build_regex_from_schema(json.dumps(checked))
    for doc in _documents(regex, data.draw, 3):
        jsonschema.validate(json.loads(doc), schema, cls=jsonschema.Draft202012Validator)


# ------------------------------------------------------------------ refused, before any work

OBJ_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OBJ_B = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
REFUSED = {
    "allOf-two-objects": ({"allOf": [OBJ_A, OBJ_B]}, "allOf"),
    "allOf-unsatisfiable": ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "allOf"),
    "enum-empty": ({"enum": []}, "enum must be a non-empty"),
    "anyOf-empty": ({"anyOf": []}, "anyOf must be a non-empty"),
    "type-empty": ({"type": []}, "no document has no type"),
    "oneOf-overlap": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "can both match"),
    "oneOf-values": ({"oneOf": [{"enum": [1, 2]}, {"type": "integer"}]}, "can both match"),
    "required-undeclared": (
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
        r"required names \['b'\]",
    ),
    "not": ({"not": {"type": "string"}}, "'not'"),
    "false": ("false", "schema false"),
    "enum-wrong-type": ({"type": "string", "enum": [1, 2]}, "no value of enum"),
    "const-wrong-type": ({"type": "integer", "const": "x"}, "no value of enum"),
    "escaped-name": ({"type": "object", "properties": {'a"b': {}}}, "needs escaping"),
    "const-key": ({"const": {"k.": 1}}, "object key 'k.'"),
    "const-digits": ({"const": 4.894077948767008e-296}, "not written back exactly"),
    "enum-big-int": ({"enum": [2**64]}, "not written back exactly"),
    "format-time": ({"type": "string", "format": "time"}, "format = 'time'"),
    "format-length": ({"type": "string", "format": "date", "maxLength": 3}, "format is supported"),
    "pattern-dot": ({"type": "string", "pattern": "a.b"}, "must escape"),
    "pattern-negated": ({"type": "string", "pattern": "[^a]"}, "must escape"),
    "lengths": ({"type": "string", "minLength": 3, "maxLength": 2}, "nothing satisfies"),
    "length-untyped": ({"anyOf": [{"type": "string"}], "minLength": 2}, "minLength"),
    "anyOf-and-type": ({"type": "string", "anyOf": [{"type": "integer"}]}, "beside it"),
    "unknown": ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    "number-bounds": ({"type": "number", "maximum": 3}, "'maximum'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_schemas_outside_the_subset_are_refused_up_front(case):
    schema, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        ll.SamplingParams.create(1, json_schema=schema)


def test_exclusive_one_of_and_one_schema_all_of_are_accepted():
    one_of = {"oneOf": [{"type": "integer"}, {"type": "string"}, {"enum": [None]}]}
    assert "anyOf" in checked_schema(one_of, "s")
    assert checked_schema({"allOf": [OBJ_A]}, "s") == OBJ_A
    assert checked_schema({"type": "string", "enum": ["a", 1]}, "s") == {"enum": ["a"]}


# ------------------------------------------------------------------ regex errors

REGEX_ERRORS = {
    r"(a)\1": r"a backreference \(\\1\)",
    "a(?=b)": r"a lookaround \(\(\?=",
    "(?<!x)y": r"a lookaround \(\(\?<!",
    "(ab": "an unbalanced parenthesis",
    "ab)": "an unbalanced parenthesis",
    "^ab": r"an anchor \(\^\)",
    r"\bab": r"an anchor \(\\b\)",
}


@pytest.mark.parametrize("regex", list(REGEX_ERRORS))
def test_regex_errors_name_the_construct(regex):
    message = r"^regex is not a supported regex: " + REGEX_ERRORS[regex]
    with pytest.raises(ValueError, match=message):
        ll.SamplingParams.create(1, regex=regex)
    with pytest.raises(ValueError, match=r"^regex\[2\] is not a supported regex: "):
        ll.SamplingParams.create(3, regex=[None, "a", regex])


# ------------------------------------------------------------------ settings that would cut


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(choice=["yes", "no"], min_tokens=10),
        dict(choice=["yes", "no"], stop=["n"]),
        dict(regex="[a-z]+", stop_sequences=[[5]]),
        dict(json_schema={"type": "integer"}, min_tokens=[0, 3]),
    ],
    ids=["choice-min-tokens", "choice-stop", "regex-stop-sequences", "schema-row-1"],
)
def test_settings_that_would_break_a_constrained_document_are_refused(kwargs):
    with pytest.raises(ValueError, match=r"row \d has .* a constrained row ends"):
        ll.SamplingParams.create(2, **kwargs)
    unconstrained = {k: v for k, v in kwargs.items() if k not in ("choice", "regex", "json_schema")}
    ll.SamplingParams.create(2, **unconstrained)  # alone they are fine


def test_a_stop_token_the_constraint_can_write_is_refused():
    from logitloop.decoding.engine.host import constraint_tables
    from logitloop.decoding.loop.runner import model_info

    from .noise_model import noise_model, shipped_tokenizer

    model, tok = noise_model(), shipped_tokenizer()
    n_id = next(i for i, b in enumerate(tok.all_token_bytes()) if b == b"n")
    params = ll.SamplingParams.create(1, choice=["yes", "no"], stop_token_ids=[n_id])
    with pytest.raises(ValueError, match=f"row 0: stop token id {n_id} is a token its choice"):
        ll.generate(model, [[1, 2]], params)
    with pytest.raises(ValueError, match=f"stop token id {n_id}"):
        ll.generate_many(
            model, [ll.Request([1, 2], dict(choice=["yes", "no"], stop_token_ids=[n_id]))]
        )
    far = next(i for i, b in enumerate(tok.all_token_bytes()) if b == b"z")
    ok = ll.SamplingParams.create(1, choice=["yes", "no"], stop_token_ids=[far])
    assert constraint_tables(model_info(model), ok)[0] is not None  # never written: fine
