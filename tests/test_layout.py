"""The package's shape: no import circles between modules, no module over 500 lines (split by
concept, not by a count), and each followed API in one package (DESIGN §1)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "stepgraph"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The stepgraph modules ``path`` imports, at module level or inside functions alike."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the submodule when there is one
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    # a package's __init__ re-exports its modules: an edge into it is not a circle of its own
    return {m: {t for t in _imports(p, modules)} for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among modules (package ``__init__``s excluded), or ``None``."""
    packages = {m for m in graph if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    edges = {m: graph[m] - packages for m in graph if m not in packages}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_catches_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_between_modules():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PKG)} has {n} lines; give its parts names"


def test_runner_configs_and_graph_update_apis_each_live_in_one_package():
    import stepgraph
    from stepgraph import configs, graph_update, runner

    for name in ("CudaGraphRunner", "RunnerConfig", "get_global_graph_memory_pool", "freeze_gc"):
        assert getattr(stepgraph, name).__module__.startswith("stepgraph.runner")
    for name in configs.__all__:
        obj = getattr(configs, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith(("stepgraph.configs", "stepgraph.buckets")), name
    assert runner.CudaGraphRunner.__module__ == "stepgraph.runner.graph_runner"
    assert graph_update.exec_updater.FlashExecUpdater.__module__.startswith(
        "stepgraph.graph_update"
    )
    for old in ("capture", "capture_steps", "input_buffers", "exact", "config_runner", "piecewise"):
        assert not (PKG / f"{old}.py").exists(), f"stepgraph/{old}.py should be gone"


def test_docs_structure_lists_every_module_and_no_missing_one():
    doc = (PKG.parent / "docs" / "structure.md").read_text()
    listed = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `stepgraph/")}
    modules = {str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")}
    assert modules - listed == set(), "add these modules to docs/structure.md"
    assert listed - modules == set(), "docs/structure.md lists modules that are gone"


def test_kernels_keep_few_entries_at_their_top_level():
    """The kernels sit in subpackages by role; the top level holds at most 12 entries."""
    kernels = PKG / "kernels"
    top = [p for p in kernels.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    assert len(top) <= 12, f"stepgraph/kernels/ holds {len(top)} entries; give them a subpackage"
