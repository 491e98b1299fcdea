"""The layout's rules, checked on the source by testkit/structure.py (`python -m
testkit.structure` prints them all): no import cycles, dependencies flow one way (formats <-
scheduler <- modules <- dist_runner.py, scripts), the parts of modules/ import one way too, no
private names imported across packages, and in product code (formats, scheduler, modules,
scripts, dist_runner.py, udp_hole_punching_test) no function over 60 lines, no file over 600,
no class over 350, the Trainer within 300 and no sync mode compared as a string literal."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from testkit import structure as st

ROOT = st.ROOT
MAY_IMPORT = {
    "formats": set(),
    "scheduler": {"formats"},
    "modules": {"formats", "scheduler"},
    "dist_runner": {"formats", "scheduler", "modules"},
    "scripts": {"formats", "scheduler", "modules"},
    "udp_hole_punching_test": {"formats", "modules"},
    "testkit": {"formats", "scheduler", "modules", "scripts", "dist_runner"},
}


@pytest.fixture(scope="module")
def graph() -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    """The import graph of the checkout, and the private names imported across packages."""
    return st.import_graph()


def test_no_import_cycles(graph) -> None:
    assert st.import_cycles(graph[0]) == [], "import cycles"


def test_dependencies_flow_one_way(graph) -> None:
    def top(m: str) -> str:
        return m.split(".")[0]

    bad = sorted((a, b) for a, b in graph[0].edges if top(a) in MAY_IMPORT
                 and top(b) != top(a) and top(b) not in MAY_IMPORT[top(a)])
    assert bad == []


def test_no_private_names_imported_across_packages(graph) -> None:
    assert graph[1] == []


def test_runtime_parts_import_one_way(graph) -> None:
    """An edge A -> B when a module of modules/A imports one of modules/B (lazy imports and
    TYPE_CHECKING ones included): no pair imports both ways, and no longer cycle either."""
    assert st.two_way_subpackages(graph[0]) == []


def test_the_structure_report_sees_a_two_way_pair_and_a_cycle() -> None:
    """The rule above on a made-up graph, so that it could fail."""
    g = nx.DiGraph([("modules.a.x", "modules.b.y"), ("modules.b.z", "modules.a.w"),
                    ("modules.c.x", "modules.d.x"), ("modules.d.x", "modules.e.x"),
                    ("modules.e.x", "modules.c.x"), ("modules.config", "modules.f.x")])
    assert st.two_way_subpackages(g) == ["a <-> b", "c -> d -> e"]


@pytest.mark.parametrize("path", st.product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_functions_fit_on_a_screen(path: Path) -> None:
    assert st.long_functions(path) == []


def test_product_files_and_classes_are_small() -> None:
    files = st.product_files()
    big = [f"{p.relative_to(ROOT)}" for p in files
           if len(p.read_text().splitlines()) > st.MAX_FILE_LINES]
    classes = [f"{p.relative_to(ROOT)}: {c} ({n})" for p in files
               for c, n in st.class_lengths(p).items() if n > st.MAX_CLASS_LINES]
    trainer = st.class_lengths(ROOT / "modules" / "train" / "trainer.py")["Trainer"]
    assert (big, classes) == ([], [])
    assert trainer <= st.MAX_TRAINER_LINES


def test_sync_modes_are_asked_of_their_rule_not_compared_as_strings() -> None:
    """formats/sync_rules.py declares what each rule implies; product code asks the rule."""
    literal = [str(p.relative_to(ROOT)) for p in st.product_files()
               if st.compares_sync_literals(p)]
    assert len(literal) <= st.MAX_SYNC_LITERAL_FILES, literal


def test_the_structure_report_runs_and_every_rule_holds(capsys) -> None:
    assert st.main([]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("check, code, seen", [
    (st.compares_sync_literals, 'if sync.mode == "diloco":\n    pass\n', True),
    (st.compares_sync_literals, 'ok = mode in ("allreduce", "x")\n', True),
    (st.compares_sync_literals, 'local = sync.rule.local_steps\n', False),
    (st.compares_sync_literals, 'name = "diloco"\nprint(f"--sync {name}")\n', False),
    (st.edits_sys_path, "import sys\nsys.path.insert(0, 'x')\n", True),
    (st.edits_sys_path, "import sys\nsys.path[0] = 'x'\n", True),
    (st.edits_sys_path, "import sys\nsys.path.append('x')\n", True),
    (st.edits_sys_path, "import sys\nprint(sys.path)\nother.path.insert(0, 'x')\n", False)])
def test_a_rule_sees_what_it_counts(tmp_path, check, code, seen) -> None:
    """A sync-mode literal compared as a string; an edit of sys.path (scripts import through
    the installed packages; only PATH_EDITS_ALLOWED edit it)."""
    f = tmp_path / "x.py"
    f.write_text(code)
    assert check(f) is seen
