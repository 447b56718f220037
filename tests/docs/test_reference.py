"""The API reference (docs/reference/, rendered by mkdocstrings) documents every name of
`logitloop.__all__`, each under the name `ll.<name>` gives it."""

from __future__ import annotations

import importlib
import re

import logitloop as ll
from tests.docs import ROOT

DIRECTIVE = re.compile(r"^::: (\S+)$", re.MULTILINE)


def resolve(path: str):
    """The object a mkdocstrings identifier names: the longest importable module prefix,
    then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def documented() -> dict[str, list[object]]:
    """name -> the objects the reference pages document under that name."""
    found: dict[str, list[object]] = {}
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for path in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            found.setdefault(path.rsplit(".", 1)[-1], []).append(resolve(path))
    return found


def test_every_public_name_has_a_reference_entry():
    found = documented()
    missing = [
        name for name in ll.__all__
        if not any(obj is getattr(ll, name) for obj in found.get(name, []))
    ]  # fmt: skip
    assert not missing, f"names of logitloop.__all__ missing from docs/reference/: {missing}"


def test_reference_pages_are_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs" / "reference").glob("*.md"))
    assert [p for p in pages if f"reference/{p}" not in nav] == []
