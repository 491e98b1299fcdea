"""The code's structure, measured from the checkout against the project's size and layering rules.

    python -m testkit.structure [--json]

Prints one line per rule (what is counted, the count, the limit) and the offenders: import
cycles, product functions over 60 lines, product files over 600, classes over 350, the
Trainer's length, `FLAG_OF_FIELD`, product files that compare sync modes as string literals,
two-way imports between `modules/` sub-packages and dated lines in the guides (docs/*.md).
Exit status 0 when every rule holds, 1 otherwise. tests/test_layout.py asserts the rules
that hold today from the same functions.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("formats", "scheduler", "modules", "scripts", "testkit", "udp_hole_punching_test",
            "benchmarks", "dist_runner")
PRODUCT = ("formats", "scheduler", "modules", "scripts", "udp_hole_punching_test")
"""Product code: what users run (not tests, testkit or benchmarks); plus dist_runner.py."""
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 350
MAX_TRAINER_LINES = 300
MAX_SYNC_LITERAL_FILES = 3
MAX_DATED_DOC_LINES = 10
PATH_EDITS_ALLOWED = ("dist_runner.py", "scheduler/scheduler.py", "scripts/gpu_check.py",
                      "scripts/gpu_multi.py")
"""The files that may put the checkout on sys.path: the two documented entry points, and the
GPU host's check, which runs from a checkout without installing it (no pip index there)."""
SYNC_MODE_NAMES = frozenset({"allreduce", "diloco"})
DATED = re.compile(r"(?<!\d)20\d\d-[01]\d-[0-3]\d(?!\d)")


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    """A source file's text and syntax tree, read and parsed once per process."""
    text = path.read_text()
    return text, ast.parse(text)


def module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted module name of a source file under root (`pkg/__init__.py` -> `pkg`)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(root: Path = ROOT) -> dict[str, Path]:
    """{module name: path} of every project source file (tests excluded)."""
    out = {}
    for pkg in PACKAGES:
        base = root / pkg
        paths = [base.with_suffix(".py")] if not base.is_dir() else sorted(base.rglob("*.py"))
        out.update({module_name(p, root): p for p in paths if ".venv" not in p.parts})
    return out


def product_files(root: Path = ROOT) -> list[Path]:
    """Every product source file: dist_runner.py and the PRODUCT packages."""
    files = [root / "dist_runner.py"]
    for pkg in PRODUCT:
        files += [p for p in sorted((root / pkg).rglob("*.py")) if ".venv" not in p.parts]
    return files


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import in the file, lazy
    imports inside functions included."""
    out = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(_parsed(path)[1]):
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


def import_graph(root: Path = ROOT) -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    """(module import graph, private names imported across top-level packages)."""
    found = sources(root)
    known = set(found)
    g = nx.DiGraph()
    private = []
    for name, path in found.items():
        g.add_node(name)
        for target, names in imports(path, name, known):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                g.add_edge(name, target)
            top_from, top_to = name.split(".")[0], target.split(".")[0]
            private += [(name, target, n) for n in names
                        if n.startswith("_") and not n.startswith("__") and top_from != top_to]
    return g, private


def import_cycles(g: nx.DiGraph) -> list[list[str]]:
    """Every set of modules that import each other (directly or around a loop)."""
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def runtime_part(module: str) -> str | None:
    """The node of a module in the graph of modules/'s parts: its sub-package (modules.comm.nccl
    -> comm); a module directly in modules/ is a node of its own (modules.config -> config), so
    a shared base such as config.py importing up into a sub-package counts; None outside."""
    parts = module.split(".")
    if parts[0] != "modules":
        return None
    return parts[1] if len(parts) > 1 else "modules"


def runtime_parts(g: nx.DiGraph) -> nx.DiGraph:
    """The graph of modules/'s parts: A -> B when a module of A imports one of B."""
    parts = nx.DiGraph()
    for a, b in g.edges:
        pa, pb = runtime_part(a), runtime_part(b)
        if pa is not None and pb is not None and pa != pb:
            parts.add_edge(pa, pb)
    return parts


def two_way_subpackages(g: nx.DiGraph) -> list[str]:
    """Pairs of modules/'s parts that import each other, then longer cycles among them."""
    parts = runtime_parts(g)
    both = [f"{a} <-> {b}" for a, b in sorted(parts.edges) if a < b and parts.has_edge(b, a)]
    return both + [" -> ".join(c) for c in import_cycles(parts) if len(c) > 2]


def _spans(path: Path, kinds: tuple[type, ...]) -> list[tuple[str, int, int]]:
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1)
            for n in ast.walk(_parsed(path)[1]) if isinstance(n, kinds)]


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'name (N lines, line L)' of every function in the file longer than limit."""
    return [f"{name} ({n} lines, line {line})"
            for name, line, n in _spans(path, (ast.FunctionDef, ast.AsyncFunctionDef))
            if n > limit]


def class_lengths(path: Path) -> dict[str, int]:
    """{class name: lines} of every class in the file."""
    return {name: n for name, _, n in _spans(path, (ast.ClassDef,))}


def compares_sync_literals(path: Path) -> bool:
    """Whether the file compares something with a sync mode's name written as a literal
    (`mode == "diloco"`, `x in ("allreduce", ...)`): the registry's job, not each file's."""
    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in SYNC_MODE_NAMES
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(literal(e) for e in node.elts)
        return False

    return any(isinstance(n, ast.Compare) and any(literal(x) for x in [n.left, *n.comparators])
               for n in ast.walk(_parsed(path)[1]))


def edits_sys_path(path: Path) -> bool:
    """Whether the file calls sys.path.insert / append / extend (or assigns into sys.path)."""
    for node in ast.walk(_parsed(path)[1]):
        target = node.func if isinstance(node, ast.Call) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Subscript):
            target = target.value
        while isinstance(target, ast.Attribute) and target.attr in ("insert", "append",
                                                                    "extend"):
            target = target.value
        if (isinstance(target, ast.Attribute) and target.attr == "path"
                and isinstance(target.value, ast.Name) and target.value.id == "sys"):
            return True
    return False


def dated_doc_lines(root: Path = ROOT) -> list[str]:
    """'file:line' of every line of the guides (docs/*.md, not docs/results/) with a date."""
    return [f"{p.relative_to(root)}:{i}" for p in sorted((root / "docs").glob("*.md"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if DATED.search(line)]


@dataclass
class Rule:
    """One measured rule: what is counted, how many, the limit, the offenders."""

    what: str
    count: int
    limit: int
    offenders: list[str] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        """Whether the count is within the limit."""
        return self.count <= self.limit


def _rel(p: Path, root: Path) -> str:
    return str(p.relative_to(root))


def measure(root: Path = ROOT) -> list[Rule]:
    """Every rule, measured on the checkout at root."""
    g, _ = import_graph(root)
    files = product_files(root)
    cycles = import_cycles(g)
    longf = [f"{_rel(p, root)}: {f}" for p in files for f in long_functions(p)]
    lines = {p: len(_parsed(p)[0].splitlines()) for p in files}
    big = [f"{_rel(p, root)} ({n})" for p, n in lines.items() if n > MAX_FILE_LINES]
    spans = {p: class_lengths(p) for p in files}
    classes = [f"{_rel(p, root)}: {c} ({n})" for p, cs in spans.items()
               for c, n in cs.items() if n > MAX_CLASS_LINES]
    trainer = max((cs.get("Trainer", 0) for cs in spans.values()), default=0)
    flag_map = [_rel(p, root) for p in files if "FLAG_OF_FIELD" in _parsed(p)[0]]
    literal = [_rel(p, root) for p in files if compares_sync_literals(p)]
    two_way = two_way_subpackages(g)
    dated = dated_doc_lines(root)
    path_edits = [r for r in (_rel(p, root) for p in sources(root).values()
                              if edits_sys_path(p)) if r not in PATH_EDITS_ALLOWED]
    return [
        Rule("import cycles", len(cycles), 0, [" ".join(c) for c in cycles]),
        Rule(f"product functions over {MAX_FUNCTION_LINES} lines", len(longf), 0, longf),
        Rule(f"product files over {MAX_FILE_LINES} lines", len(big), 0, big),
        Rule(f"classes over {MAX_CLASS_LINES} lines", len(classes), 0, classes),
        Rule("Trainer lines", trainer, MAX_TRAINER_LINES),
        Rule("files using FLAG_OF_FIELD", len(flag_map), 0, flag_map),
        Rule("product files comparing sync-mode literals", len(literal),
             MAX_SYNC_LITERAL_FILES, literal),
        Rule("two-way imports or cycles between modules/ parts", len(two_way), 0, two_way),
        Rule("dated lines in docs/*.md", len(dated), MAX_DATED_DOC_LINES, dated),
        Rule("files editing sys.path besides " + ", ".join(PATH_EDITS_ALLOWED),
             len(path_edits), 0, path_edits),
    ]


def main(argv: list[str] | None = None) -> int:
    """Print the rules (a table, or --json); 0 when all hold."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the rules as JSON")
    args = p.parse_args(argv)
    rules = measure()
    if args.json:
        print(json.dumps([{**vars(r), "holds": r.holds} for r in rules], indent=1))
    else:
        for r in rules:
            print(f"{'ok  ' if r.holds else 'MISS'} {r.what}: {r.count} (limit {r.limit})")
            for o in r.offenders:
                print(f"       {o}")
    return 0 if all(r.holds for r in rules) else 1


if __name__ == "__main__":
    sys.exit(main())
