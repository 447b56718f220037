"""A chat template rendered under a time limit and an output-size limit, once.

A checkpoint's template is foreign code: jinja2's sandbox keeps it from touching anything
but its variables, not from looping for hours (`range` allows 100 000 items, and loops
nest) or from building a 100 MB string (`'a' * 100000000`). So `render` bounds both:

- time: the template's compiled code (jinja compiles a template to Python) is traced while
  it runs (`sys.settrace`, in the rendering thread only, so it works off the main thread
  and needs no signal), and every line it executes checks the clock; a loop with an empty
  body executes a line per iteration too. Python code the template calls (jinja's filters)
  is not traced: those run in time linear in their input, which the size limit bounds.
- size: the rendered text as it is produced, and every `*`, `**` and `+` the template
  evaluates (the cheap ways to build a huge value in one step) before it is computed.

A template that raises is not rendered again to find the message it refused: the messages
it read are recorded as it reads them, and the last one is named.

`RenderLimits` holds the limits (`ChatTemplate(..., limits=RenderLimits(time_s=10))`).
They are passed, never looked up: a `BoundedSandbox` environment holds the limits its
templates' `*`, `**` and `+` check, and `render` takes them too (the same ones).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEMPLATE_FILE = "<template>"  # the file name jinja gives the code of `from_string`
_CHECK_EVERY = 256  # lines between clock reads
_MAX_POWER_BITS = 1 << 16  # an integer of about 20 000 digits


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderLimits:
    """How long one rendering may take (seconds of wall time) and how long its text (and any
    string or list it builds) may be, in characters (items). The defaults are far above
    what real templates need: a long conversation renders in milliseconds."""

    time_s: float = 2.0
    max_chars: int = 4_000_000

    def __post_init__(self):
        if not self.time_s > 0:
            raise ValueError(f"RenderLimits.time_s = {self.time_s!r} must be > 0")
        if isinstance(self.max_chars, bool) or not (
            isinstance(self.max_chars, (int, np.integer)) and self.max_chars > 0
        ):
            raise ValueError(f"RenderLimits.max_chars = {self.max_chars!r} must be an int > 0")


class LimitExceeded(Exception):
    """The template went past one of its limits (`render` turns it into a ValueError)."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose `*`, `**` and `+` refuse results past
    `limits.max_chars` before building them. The limits are the environment's own (a
    template compiled in it renders under them): passed in, not looked up."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, limits: RenderLimits, **options: Any):
        super().__init__(**options)
        self.limits = limits

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limit = self.limits.max_chars
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _sized(seq) and isinstance(times, int) and len(seq) * times > limit:
                    raise LimitExceeded(f"'*' would build {len(seq) * times} items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > _MAX_POWER_BITS:
                raise LimitExceeded(f"'**' would build an integer of {right} * log2({left}) bits")
        elif operator == "+" and _sized(left) and _sized(right):
            if len(left) + len(right) > limit:
                raise LimitExceeded(f"'+' would build {len(left) + len(right)} items")
        return super().call_binop(context, operator, left, right)


def _sized(x: Any) -> bool:
    return isinstance(x, (str, list, tuple))


class _Message(dict):
    """A message as the template sees it: a plain dict that records when it is read."""

    __slots__ = ("index", "reads")

    def __getitem__(self, key):
        self.reads.append(self.index)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self.reads.append(self.index)
        return dict.get(self, key, default)


def render(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
    limits: RenderLimits,
) -> str:
    """`template.render(messages=messages, **context)` within `limits`, rendered once.

    Raises `LimitExceeded` past a limit; any other error is the template's own, with
    `.message_index` set to the index of the last message it read (None if none).
    """
    bound = getattr(template.environment, "limits", limits)
    if bound != limits:
        raise ValueError(f"the template was compiled under {bound}, not {limits}")
    reads: list[int] = []
    wrapped = []
    for index, message in enumerate(messages):
        m = _Message(message)
        m.index, m.reads = index, reads
        wrapped.append(m)
    deadline = time.monotonic() + limits.time_s
    lines = 0

    def line_tracer(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise LimitExceeded(f"it ran past its time limit of {limits.time_s:g} s")
        return line_tracer

    def call_tracer(frame, event, arg):
        return line_tracer if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call_tracer)
    try:
        parts, size = [], 0
        for part in template.generate(messages=wrapped, **context):
            size += len(part)
            if size > limits.max_chars:
                raise LimitExceeded(f"its text is longer than {limits.max_chars} characters")
            parts.append(part)
        return "".join(parts)
    except LimitExceeded:
        raise
    except Exception as e:
        e.message_index = reads[-1] if reads else None
        raise
    finally:
        sys.settrace(previous)
