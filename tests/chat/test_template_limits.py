"""A chat template renders once, within a time limit and an output-size limit that raise a
ValueError naming the template's file (`logitloop.template_limits`)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from logitloop.conversation import ChatTemplate
from logitloop.template_limits import RenderLimits

from .folders import GEMMA

HI = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
QUICK = RenderLimits(time_s=0.3)


def _from_folder(tmp_path, source: str) -> ChatTemplate:
    (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    return ChatTemplate.from_folder(tmp_path)


@pytest.mark.parametrize(
    "body", ["", "{{ '' }}", "{% set x = i + j %}"], ids=["empty", "output", "set"]
)
def test_nested_loops_stop_at_the_time_limit(tmp_path, body):
    source = NESTED_LOOPS.replace("{% endfor %}", body + "{% endfor %}", 1)
    template = dataclasses.replace(_from_folder(tmp_path, source), limits=QUICK)
    start = time.monotonic()
    with pytest.raises(ValueError, match="time limit of 0.3 s") as e:
        template.render(HI)
    assert time.monotonic() - start < 3
    assert str(tmp_path / "chat_template.jinja") in str(e.value)


def test_the_time_limit_holds_off_the_main_thread():
    template = ChatTemplate(NESTED_LOOPS, limits=QUICK)
    errors = []

    def render():
        try:
            template.render(HI)
        except ValueError as e:
            errors.append(str(e))

    start = time.monotonic()
    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and time.monotonic() - start < 3
    assert len(errors) == 1 and "time limit" in errors[0]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'a' * 100000000 }}",
        "{{ 100000000 * ['a'] }}",
        "{% set s = 'a' * 3000000 %}{{ s + s }}",
        "{{ 7 ** 100000 }}",
        "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    ],
    ids=["str-times", "list-times", "plus", "power", "output"],
)
def test_huge_values_are_refused_before_they_are_built(tmp_path, source):
    template = _from_folder(tmp_path, source)
    with pytest.raises(ValueError, match="chat_template.jinja.*was stopped"):
        template.render(HI)


def test_limits_are_adjustable():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert template.render(HI * 3) == "hihihi"
    small = dataclasses.replace(template, limits=RenderLimits(max_chars=5))
    with pytest.raises(ValueError, match="longer than 5 characters"):
        small.render(HI * 3)
    for bad in (dict(time_s=0), dict(max_chars=0), dict(max_chars=1.5)):
        with pytest.raises(ValueError, match="RenderLimits"):
            RenderLimits(**bad)


def test_a_refusing_template_is_rendered_once():
    calls = []

    def tick():
        calls.append(1)
        return ""

    template = ChatTemplate(GEMMA.replace("{{ bos_token }}", "{{ bos_token }}{{ tick() }}"))
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    turns.insert(3, {"role": "user", "content": "again"})  # two user turns: refused at [3]
    with pytest.raises(ValueError, match=r"messages\[3\] \(role 'user'\).*must alternate"):
        template.render(turns, bos_token="<bos>", tick=tick)
    assert len(calls) == 1
