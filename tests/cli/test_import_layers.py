"""The command line is the package's top layer: no module outside `logitloop/cli/` imports it
(but `python -m logitloop`, which runs it), lazily inside a function included, so that an
integration (`logitloop.integrations.ray`, which `generate --ray` calls) never reaches back
up into the CLI; the job logic both use (`logitloop.jobs`) imports neither of them. Read
from the source (`import_graph`, the package's import edges): nothing is imported."""

from __future__ import annotations

from tests.decoding.test_layers import import_graph

ENTRY_POINTS = {"logitloop.__main__"}  # the only module outside cli/ that may run it


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _arrows_into(graph: dict[str, set[str]], target: str, sources: str) -> list[str]:
    """ "A -> B" for each module A under `sources` that imports a module B under `target`."""
    return sorted(
        f"{module} -> {imported}"
        for module, edges in graph.items()
        if _inside(module, sources) and module not in ENTRY_POINTS
        for imported in edges
        if _inside(imported, target)
    )


def test_nothing_below_the_command_line_imports_it():
    graph = import_graph()
    below = {m: e for m, e in graph.items() if not _inside(m, "logitloop.cli")}
    assert _arrows_into(below, "logitloop.cli", "logitloop") == []
    assert "logitloop.integrations.ray" in graph  # the module that used to


def test_the_job_logic_imports_no_integration():
    assert _arrows_into(import_graph(), "logitloop.integrations", "logitloop.jobs") == []
