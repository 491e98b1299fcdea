"""The layout's rules, checked on the source: no import cycles, dependencies flow one way
(formats <- scheduler <- modules <- dist_runner.py, scripts), the sub-packages of modules/
import one way too, no private names imported across packages, and no function of product code
(formats, scheduler, modules, scripts, dist_runner.py, udp_hole_punching_test) longer than 60
lines."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("formats", "scheduler", "modules", "scripts", "testkit", "udp_hole_punching_test",
            "benchmarks", "dist_runner")
MAY_IMPORT = {
    "formats": set(),
    "scheduler": {"formats"},
    "modules": {"formats", "scheduler"},
    "dist_runner": {"formats", "scheduler", "modules"},
    "scripts": {"formats", "scheduler", "modules"},
    "udp_hole_punching_test": {"formats", "modules"},
    "testkit": {"formats", "scheduler", "modules", "scripts", "dist_runner"},
}
MAX_FUNCTION_LINES = 60
PRODUCT = ("formats", "scheduler", "modules", "scripts", "udp_hole_punching_test")
"""Product code: what users run (not tests, testkit or benchmarks); plus dist_runner.py."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        base = ROOT / pkg
        paths = [base.with_suffix(".py")] if not base.is_dir() else sorted(base.rglob("*.py"))
        for p in paths:
            if ".venv" not in p.parts:
                out[_module_name(p)] = p
    return out


def _imports(path: Path, name: str, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import in the file, lazy
    imports inside functions included."""
    out = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{base}.{a.name}"
                out.append((sub, []) if sub in known else (base, [a.name]))
    return [(m, names) for m, names in out if m.split(".")[0] in PACKAGES]


def _graph() -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    sources = _sources()
    known = set(sources)
    g = nx.DiGraph()
    private = []
    for name, path in sources.items():
        g.add_node(name)
        for target, names in _imports(path, name, known):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                g.add_edge(name, target)
            top_from, top_to = name.split(".")[0], target.split(".")[0]
            private += [(name, target, n) for n in names
                        if n.startswith("_") and not n.startswith("__") and top_from != top_to]
    return g, private


def test_no_import_cycles() -> None:
    g, _ = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def test_dependencies_flow_one_way() -> None:
    g, _ = _graph()
    bad = sorted((a, b) for a, b in g.edges
                 if a.split(".")[0] in MAY_IMPORT and b.split(".")[0] != a.split(".")[0]
                 and b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]])
    assert bad == []


def test_no_private_names_imported_across_packages() -> None:
    _, private = _graph()
    assert private == []


def _runtime_part(module: str) -> str | None:
    """The node of a module in the graph of modules/'s parts: its sub-package (modules.comm.nccl
    -> comm); a module directly in modules/ is a node of its own (modules.config -> config), so
    a shared base such as config.py importing up into a sub-package counts; None outside."""
    parts = module.split(".")
    if parts[0] != "modules":
        return None
    return parts[1] if len(parts) > 1 else "modules"


def test_runtime_parts_import_one_way() -> None:
    """An edge A -> B when a module of modules/A imports one of modules/B (lazy imports and
    TYPE_CHECKING ones included): no pair imports both ways, and no longer cycle either."""
    g, _ = _graph()
    parts = nx.DiGraph()
    for a, b in g.edges:
        pa, pb = _runtime_part(a), _runtime_part(b)
        if pa is not None and pb is not None and pa != pb:
            parts.add_edge(pa, pb)
    both_ways = sorted((a, b) for a, b in parts.edges if a < b and parts.has_edge(b, a))
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(parts) if len(c) > 1)
    assert (both_ways, cycles) == ([], []), f"two-way: {both_ways}; cycles: {cycles}"


def _product_files() -> list[Path]:
    files = [ROOT / "dist_runner.py"]
    for pkg in PRODUCT:
        files += [p for p in sorted((ROOT / pkg).rglob("*.py")) if ".venv" not in p.parts]
    return files


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_functions_fit_on_a_screen(path: Path) -> None:
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
