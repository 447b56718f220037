"""The decoding package's layers import one way: runtime <- sampling <- loop <- engine."""

from __future__ import annotations

import ast
from pathlib import Path

import logitloop

LAYERS = ("runtime", "sampling", "loop", "engine")
DECODING = Path(logitloop.__file__).parent / "decoding"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every logitloop.decoding import in a file, top level or not."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(n, node.lineno) for n in [node.module, *names]]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m.startswith("logitloop.decoding.")]


def test_every_module_lives_in_a_layer():
    loose = [p.name for p in DECODING.glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    assert sorted(p.name for p in DECODING.iterdir() if p.is_dir() and p.name != "__pycache__") == (
        sorted(LAYERS)
    )


def test_imports_go_one_way():
    """A module imports from its own layer and the layers below it only (and no import
    inside a function exists to break a circle: there is none to break)."""
    wrong = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((DECODING / layer).glob("*.py")):
            for module, line in _imports(path):
                target = module.split(".")[2]
                if target in LAYERS and LAYERS.index(target) > rank:
                    wrong.append(f"{layer}/{path.name}:{line} imports {module}")
    assert wrong == []


def test_each_layer_says_what_it_may_import():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((DECODING / layer / "__init__.py").read_text()))
        assert doc and "May import" in doc, layer
