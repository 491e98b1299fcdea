"""The planner's import graph: no cycles inside scheduler/, and it depends only on formats/."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "scheduler"


def module_name(path: Path) -> str:
    """scheduler/simulator/kernel.py -> scheduler.simulator.kernel (a package: its __init__)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, known: set[str]) -> set[str]:
    """Every module `path` imports (module level, inside functions, under TYPE_CHECKING),
    resolved to the longest name in `known` when it is one of them."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    resolved = set()
    for name in names:
        parts = name.split(".")
        prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        resolved.add(next((p for p in prefixes if p in known), name))
    return resolved


def graph() -> dict[str, set[str]]:
    """Module -> the modules of scheduler/ it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {m: imported(p, known) & known - {m} for m, p in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_scheduler():
    edges = graph()
    assert "scheduler.simulator.kernel" in edges and "scheduler.planning" in edges
    assert "scheduler.cost_simulated" in edges["scheduler.planning"]
    assert find_cycle(edges) == []


def test_the_scheduler_depends_only_on_formats():
    # formats <- scheduler <- modules <- dist_runner.py, scripts
    later = ("modules", "dist_runner", "scripts", "testkit", "udp_hole_punching_test")
    for path in PACKAGE.rglob("*.py"):
        for name in imported(path, set()):
            assert name.split(".")[0] not in later, f"{path} imports {name}"
