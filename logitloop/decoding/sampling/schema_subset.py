"""The JSON Schema subset structured output accepts: the keywords and combinations whose
translation by `outlines-core` (0.2) is exact, in the sense that every document the
automaton accepts validates against the schema. Everything else is refused with a
ValueError naming the place in the schema, before any model work.

Accepted, per (sub)schema:

- annotations: `title`, `description`, `$schema`, `$id`, `$comment`, `examples`, `default`,
  `deprecated`, `readOnly`, `writeOnly`;
- `type`: one of "null", "boolean", "integer", "number", "string", "array", "object", or a
  non-empty list of them;
- `enum` (non-empty) and `const`: with a `type` beside them, the values of other types are
  dropped (none left: refused as unsatisfiable); objects inside them only with plain keys
  (letters, digits, `_`, space), which outlines-core copies unescaped; numbers only those
  it reads back exactly (integers below 2**53, decimals of at most 15 digits);
- integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` spanning at most
  `MAX_INTEGER_RANGE` values (translated to an `enum`);
- strings: `minLength`, `maxLength`, `format` (date-time, date, uuid), `pattern` when
  the pattern can only produce characters a JSON string holds unescaped (no `"`, `\\`,
  control characters: a `.` or `[^...]` is refused);
- arrays: `items`, `prefixItems` (alone), `minItems`, `maxItems`;
- objects (`type` "object", or no `type` and `properties`): `properties` (names a JSON
  string holds unescaped), `required` (names among `properties`), `additionalProperties`;
- `anyOf` (non-empty); `oneOf` when its branches provably exclude each other (their types,
  or their `enum`/`const` values, are disjoint; "integer" overlaps "number"), translated as
  `anyOf`; `allOf` of one schema with nothing beside it; `$ref` to this document with `$defs`
  or `definitions`.

Refused: `not`, `allOf` of several schemas, overlapping `oneOf`, empty `enum`/`anyOf`/`oneOf`/
`type`, `required` naming an undeclared property, the boolean schema `false`, numeric bounds
on numbers, and every keyword not listed (`multipleOf`, `uniqueItems`, `if`, ...).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import outlines_core

MAX_INTEGER_RANGE = 1024  # integer bounds spanning at most this many values become an enum

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$schema",
        "$id",
        "$comment",
        "examples",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# ("time" is left out: outlines-core 0.2 writes its fraction as `\\.`, an invalid escape.)
STRING_FORMATS = frozenset({"date-time", "date", "uuid"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength", "format", "pattern"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "integer": frozenset(_BOUNDS),
}
_GENERAL = frozenset({"type", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions"})
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_ ]*")
_BYTES = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
# Bytes a JSON string cannot hold unescaped: '"', '\', C0 controls, DEL (and, through the
# UTF-8 lead byte 0xC2, the C1 controls U+0080..U+009F, which outlines-core leaves out too).
_UNSAFE_BYTES = frozenset({0x22, 0x5C, 0x7F, *range(0x20)})


def checked_schema(schema: Any, where: str) -> Any:
    """The schema as outlines-core should translate it (integer bounds as enums, exclusive
    `oneOf` as `anyOf`, enum values of other types dropped); a ValueError naming the place
    for anything outside the subset above."""
    if schema is False:
        raise ValueError(f"{where} is the schema false: no document satisfies it")
    return _node(schema, where)


def _node(node: Any, path: str) -> Any:
    if not isinstance(node, Mapping):
        raise ValueError(f"{path} must be a JSON schema object, got {node!r}")
    node = dict(node)
    while "allOf" in node:
        node = _single_all_of(node, path)
    types = _types(node, path)
    if not types and _BY_TYPE["object"] & node.keys():
        types = ("object",)  # properties without a type: outlines-core writes an object
    allowed = ANNOTATIONS | _GENERAL
    if len(types) == 1:
        allowed |= _BY_TYPE.get(types[0], frozenset())
    for key in node:
        if key not in allowed:
            raise ValueError(_unknown(key, types, path))
    combined = [k for k in ("anyOf", "oneOf", "$ref") if k in node]
    beside = [k for k in node if k not in ANNOTATIONS | {"$defs", "definitions"}]
    if combined and len(beside) > 1:
        raise ValueError(
            f"{path}: {combined[0]} with {[k for k in beside if k != combined[0]]} beside it: "
            "a document must satisfy both, which the automaton cannot enforce: refused"
        )
    if types == ("integer",) and any(k in node for k in _BOUNDS):
        node = _integer_bounds(node, path)
    if "enum" in node or "const" in node:
        return _values(node, types, path)
    if "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#")):
        raise ValueError(f"{path}.$ref = {node['$ref']!r}: only references into this schema")
    out = dict(node)
    for key in ("$defs", "definitions"):
        if key in node:
            out[key] = {k: _node(v, f"{path}.{key}.{k}") for k, v in _mapping(node, key, path)}
    for key in ("anyOf", "oneOf"):
        if key in node:
            branches = node[key]
            if not isinstance(branches, list) or not branches:
                raise ValueError(f"{path}.{key} must be a non-empty list: no document satisfies []")
            out[key] = [_node(b, f"{path}.{key}[{i}]") for i, b in enumerate(branches)]
    if "oneOf" in node:
        _exclusive(out["oneOf"], path)
        out["anyOf"] = out.pop("oneOf")  # no document matches two: "one of" is "any of"
    if types == ("object",):
        _object(node, out, path)
    if types == ("array",):
        _array(node, out, path)
    if types == ("string",):
        _string(node, path)
    return out


def _unknown(key: str, types: tuple[str, ...], path: str) -> str:
    owner = next((t for t, keys in _BY_TYPE.items() if key in keys), None)
    if owner is not None and len(types) != 1:
        return f'{path} uses {key!r}, which needs "type": {owner!r} alone beside it'
    if owner is not None:
        return f"{path} uses {key!r}, which applies to {owner} schemas, not {list(types)}"
    return (
        f"{path} uses {key!r}, which structured output does not translate exactly: refused "
        "rather than ignored (the supported keywords: logitloop.decoding.sampling.schema_subset)"
    )


def _single_all_of(node: dict, path: str) -> dict:
    parts = node["allOf"]
    rest = [k for k in node if k != "allOf" and k not in ANNOTATIONS]
    if not isinstance(parts, list) or len(parts) != 1 or rest:
        raise ValueError(
            f"{path}.allOf: a document must satisfy every schema at once, which the automaton "
            "cannot enforce: refused (an allOf of one schema, alone, is accepted)"
        )
    if not isinstance(parts[0], Mapping):
        raise ValueError(f"{path}.allOf[0] must be a JSON schema object")
    return dict(parts[0])


def _types(node: Mapping, path: str) -> tuple[str, ...]:
    value = node.get("type")
    if value is None:
        return ()
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not listed:
        raise ValueError(f"{path}.type = {value!r}: no document has no type")
    for t in listed:
        if t not in TYPES:
            raise ValueError(f"{path}.type = {value!r}: each type must be one of {TYPES}")
    return tuple(dict.fromkeys(listed))


def _mapping(node: Mapping, key: str, path: str):
    value = node[key]
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}.{key} must map names to schemas")
    return value.items()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise ValueError(f"{value!r} is not a JSON value")


def _fits(value: Any, types: tuple[str, ...]) -> bool:
    kind = _json_type(value)
    return not types or kind in types or (kind == "integer" and "number" in types)


def _exact_number(value: Any) -> bool:
    """Whether outlines-core (serde_json's float parsing) writes `value` back as itself:
    integers below 2**53; other numbers of at most 15 significant digits and a decimal
    exponent within 22 (the range where decimal-to-binary needs no extra precision)."""
    if isinstance(value, int):
        return abs(value) < 2**53
    fifteen = f"{value:.14e}"  # 15 significant digits
    return float(fifteen) == value and abs(int(fifteen.partition("e")[2])) <= 22


def _plain_keys(value: Any, path: str) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not _exact_number(value):
            raise ValueError(
                f"{path}: the number {value!r} in an enum/const value is not written back "
                "exactly: use at most 15 significant digits (integers below 2**53)"
            )
    if isinstance(value, dict):
        for k, v in value.items():
            if not _PLAIN_KEY.fullmatch(k):
                raise ValueError(
                    f"{path}: the object key {k!r} in an enum/const value: only letters, digits, "
                    "'_' and spaces are translated exactly"
                )
            _plain_keys(v, path)
    elif isinstance(value, list):
        for v in value:
            _plain_keys(v, path)


def _values(node: dict, types: tuple[str, ...], path: str) -> dict:
    """An `enum`/`const` node as an enum of the values that fit its `type`."""
    if "const" in node:
        if "enum" in node:
            raise ValueError(f"{path} has both enum and const: give one")
        values = [node["const"]]
    else:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}.enum must be a non-empty list: no document satisfies []")
    others = [k for k in node if k not in ANNOTATIONS | {"type", "enum", "const"}]
    if others:
        raise ValueError(f"{path}: enum/const with {others} beside them is not translated exactly")
    for v in values:
        _plain_keys(v, path)
    kept = [v for v in values if _fits(v, types)]
    if not kept:
        raise ValueError(f"{path}: no value of enum/const {values!r} has type {list(types)}")
    return {"enum": kept}


def _exclusive(branches: list, path: str) -> None:
    """A ValueError unless no document can satisfy two of the (checked) branches."""
    kinds = []
    for i, b in enumerate(branches):
        if "enum" in b:
            kinds.append(
                (
                    "values",
                    [json.dumps(v, sort_keys=True) for v in b["enum"]],
                    {_json_type(v) for v in b["enum"]},
                )
            )
        elif "type" in b and not ({"anyOf", "$ref"} & b.keys()):
            t = set(_types(b, path))
            kinds.append(("types", None, t | ({"integer"} if "number" in t else set())))
        else:
            raise ValueError(
                f"{path}.oneOf[{i}] has neither a type nor enum/const values: oneOf is accepted "
                "only when its branches provably exclude each other (then it is anyOf)"
            )
    for i in range(len(kinds)):
        for j in range(i):
            (ki, vi, ti), (kj, vj, tj) = kinds[i], kinds[j]
            if ki == kj == "values":
                overlap = set(vi) & set(vj)
            elif ki == "values" or kj == "values":
                values, t = (vi, tj) if ki == "values" else (vj, ti)
                overlap = {v for v in values if _json_type(json.loads(v)) in t}
            else:
                overlap = ti & tj
            if overlap:
                raise ValueError(
                    f"{path}.oneOf[{j}] and oneOf[{i}] can both match ({sorted(overlap)}): a "
                    "document matching two is invalid, which the automaton cannot exclude"
                )


def _object(node: Mapping, out: dict, path: str) -> None:
    props = dict(_mapping(node, "properties", path)) if "properties" in node else {}
    for name in props:
        if json.dumps(name, ensure_ascii=False)[1:-1] != name:
            raise ValueError(
                f"{path}.properties: the name {name!r} needs escaping in JSON, which "
                "outlines-core does not do"
            )
    out["type"] = "object"  # also where the properties came without one
    out["properties"] = {k: _node(v, f"{path}.properties.{k}") for k, v in props.items()}
    if "properties" not in node:
        del out["properties"]
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{path}.required must be a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise ValueError(
            f"{path}.required names {missing}, not in properties: declare them (the automaton "
            "writes only declared properties)"
        )
    extra = node.get("additionalProperties")
    if isinstance(extra, Mapping):
        out["additionalProperties"] = _node(extra, f"{path}.additionalProperties")
    elif extra is not None and not isinstance(extra, bool):
        raise ValueError(f"{path}.additionalProperties must be a boolean or a schema")


def _array(node: Mapping, out: dict, path: str) -> None:
    if "prefixItems" in node:
        items = node["prefixItems"]
        if {"items", "minItems", "maxItems"} & node.keys():
            raise ValueError(f"{path}: prefixItems is supported alone, without items/min/maxItems")
        if not isinstance(items, list) or not items:
            raise ValueError(f"{path}.prefixItems must be a non-empty list of schemas")
        out["prefixItems"] = [_node(s, f"{path}.prefixItems[{i}]") for i, s in enumerate(items)]
    if "items" in node:
        out["items"] = _node(node["items"], f"{path}.items")
    _range(node, "minItems", "maxItems", path)


def _string(node: Mapping, path: str) -> None:
    _range(node, "minLength", "maxLength", path)
    fmt = node.get("format")
    if fmt is not None and fmt not in STRING_FORMATS:
        raise ValueError(f"{path}.format = {fmt!r}: supported: {sorted(STRING_FORMATS)}")
    if fmt is not None and {"minLength", "maxLength"} & node.keys():
        raise ValueError(f"{path}: format is supported alone, without minLength/maxLength")
    if "pattern" in node:
        if {"format", "minLength", "maxLength"} & node.keys():
            raise ValueError(f"{path}: pattern is supported alone, without format or lengths")
        _safe_pattern(node["pattern"], f"{path}.pattern")


def _range(node: Mapping, low: str, high: str, path: str) -> None:
    for key in (low, high):
        v = node.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{path}.{key} = {v!r} must be an integer >= 0")
    if high in node and node.get(low, 0) > node[high]:
        raise ValueError(f"{path}: {low} {node[low]} > {high} {node[high]}: nothing satisfies it")


def _safe_pattern(pattern: Any, path: str) -> None:
    """A ValueError unless every string `pattern` matches is a JSON string's content as it
    stands (outlines-core puts the pattern between quotes as it is)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{path} must be a non-empty regex string")
    if pattern.startswith("^") or pattern.endswith("$"):
        pattern = pattern.removeprefix("^").removesuffix("$")  # the automaton matches whole
    try:
        index = outlines_core.Index(pattern, _BYTES)
    except (ValueError, TypeError) as e:
        from logitloop.decoding.sampling.regex_errors import explain

        raise ValueError(f"{path} is not a supported regex: {explain(pattern, e)}") from None
    transitions = index.get_transitions()  # {state: {byte: next state}}
    for edges in transitions.values():
        for byte, target in edges.items():
            c1 = byte == 0xC2 and any(0x80 <= b <= 0x9F for b in transitions.get(target, {}))
            if byte in _UNSAFE_BYTES or c1:
                raise ValueError(
                    f"{path} = {pattern!r} can produce {bytes([byte])!r}, which a JSON string "
                    "must escape: use a pattern without '.', negated classes or such characters"
                )
    return None


def _integer_bounds(node: Mapping[str, Any], path: str) -> dict[str, Any]:
    """An integer schema's bounds as an enum (finite, small ranges), else a ValueError."""
    lo, hi = -math.inf, math.inf
    for key in _BOUNDS:
        if key not in node:
            continue
        v = node[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{path}: {key} = {v!r} is not a finite number")
        if key == "minimum":
            lo = max(lo, math.ceil(v))
        elif key == "exclusiveMinimum":
            lo = max(lo, math.floor(v) + 1)
        elif key == "maximum":
            hi = min(hi, math.floor(v))
        else:
            hi = min(hi, math.ceil(v) - 1)
    if math.isinf(lo) or math.isinf(hi) or hi - lo + 1 > MAX_INTEGER_RANGE:
        raise ValueError(
            f"{path}: integer bounds are supported only as a finite range of at most "
            f"{MAX_INTEGER_RANGE} values (both a lower and an upper bound); outlines-core "
            "would ignore them"
        )
    if hi < lo:
        raise ValueError(f"{path}: no integer satisfies the bounds (empty range [{lo}, {hi}])")
    rest = {k: v for k, v in node.items() if k not in _BOUNDS}
    return {**rest, "enum": list(range(int(lo), int(hi) + 1))}
