"""The decoding package's layers import one way: runtime <- sampling <- loop <- engine; and
no module of the package takes part in an import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import logitloop

LAYERS = ("runtime", "sampling", "loop", "engine")
PACKAGE = Path(logitloop.__file__).parent
DECODING = PACKAGE / "decoding"


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: top level, inside a function or under
    `TYPE_CHECKING` alike (each is an edge a circle can close). `from pkg import name` is
    an edge to the submodule `pkg.name` when there is one, else to `pkg` itself."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_the_package():
    """No module imports, even lazily or for type checking only, a module that imports it
    back through any chain: what two modules share lives in a third both import."""
    graph = import_graph()
    assert len(graph) > 80  # the whole package was read
    assert circles(graph) == []
