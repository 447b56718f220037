"""What is wrong with a regex outlines-core cannot compile, in words: it says only "Failed to
build DFA" or "anchored universal start state doesn't exist"."""

from __future__ import annotations

import re

_ANCHOR_ESCAPES = {"b": r"\b", "B": r"\B", "A": r"\A", "z": r"\z", "Z": r"\Z"}
_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")


def construct(regex: str) -> str | None:
    """The first construct of `regex` the automaton cannot have, described, or None."""
    in_class = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if not in_class and (nxt in "123456789" or regex.startswith("k<", i + 1)):
                found = re.match(r"\\(\d+|k<[^>]*>)", regex[i:])
                text = found.group(0) if found else regex[i : i + 2]
                return f"a backreference ({text}) at position {i}"
            if not in_class and nxt in _ANCHOR_ESCAPES:
                return f"an anchor ({_ANCHOR_ESCAPES[nxt]}) at position {i}"
            i += 2
            continue
        if in_class:
            in_class = c != "]" or regex[i - 1] == "["
        elif c == "[":
            in_class = True
            if regex.startswith("[^", i):
                i += 1
        elif any(regex.startswith(look, i) for look in _LOOKAROUNDS):
            look = next(x for x in _LOOKAROUNDS if regex.startswith(x, i))
            return f"a lookaround ({look}...) at position {i}"
        elif c in "^$":
            return (
                f"an anchor ({c}) at position {i}: the constraint always matches the whole "
                "output, so leave ^ and $ out"
            )
        i += 1
    try:
        re.compile(regex)
    except re.error as e:
        if "parenthesis" in e.msg or "subpattern" in e.msg:
            return f"an unbalanced parenthesis ({e.msg} at position {e.pos})"
        return f"{e.msg} at position {e.pos}"
    return None


def explain(regex: str, error: Exception) -> str:
    """Why outlines-core refused `regex`: the construct, or its own first line."""
    found = construct(regex)
    if found is not None:
        return f"{found} is not supported (automata have no lookaround, backreference or anchor)"
    return str(error).splitlines()[0]
