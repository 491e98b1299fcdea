"""The README and the guides under docs/ stay current: every relative link and anchor resolves
and every repository path they name exists (in docs/results/ too), every guide is linked from
the README, the README stays an entry page (<= 400 lines), and every `python X.py [SUBCOMMAND]`
they show still parses `--help`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))
"""Measured runs the guides link (docs/results/): their links and paths must resolve too."""
README_MAX_LINES = 400

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP_DIRS = ("formats", "scheduler", "modules", "scripts", "benchmarks", "tests", "testkit",
            "udp_hole_punching_test", "docs")
TOP_FILES = ("dist_runner.py", "setup.py", "constraints-cpu.txt")
_DIRS = "|".join(TOP_DIRS)
_FILES = "|".join(re.escape(f) for f in TOP_FILES)
REPO_PATH = re.compile(rf"(?<![\w./~$-])((?:{_DIRS})/[\w./-]*|(?:{_FILES}))")
COMMAND = re.compile(r"python\s+((?:[\w-]+/)*[\w-]+\.py)(?:[ \t]+([a-z][a-z0-9-]*)\b)?")
PLACEHOLDER = re.compile(r"[*{}<>]|\.\.\.")
FLAGS_DOCUMENTED = {
    ("dist_runner.py", None), ("scheduler/scheduler.py", "scenario"),
    ("scheduler/scheduler.py", "plan"), ("scheduler/scheduler.py", "evaluate"),
    ("scheduler/scheduler.py", "simulate"), ("scheduler/scheduler.py", "explain"),
    ("scripts/launch_local.py", None), ("scripts/coordinator.py", None),
    ("scripts/measure.py", None), ("scripts/plot_run.py", None), ("scripts/tc.py", "apply"),
    ("scripts/cluster_ssh.py", None), ("scripts/local_cluster.py", "up"),
    ("benchmarks/end_to_end.py", None), ("scripts/slurm.py", "submit"),
    ("scripts/slurm.py", "run"), ("scripts/launch_specs.py", "sky"),
    ("scripts/launch_specs.py", "k8s")}
"""Entry points whose every `--flag` (from `--help`) the README or a guide mentions."""
HELP_FLAG = re.compile(r"^\s+(--[a-z0-9][a-z0-9-]*)", re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _prose(page: Path) -> str:
    """The text of a README or guide page."""
    return page.read_text(encoding="utf-8")


def _anchors(page: Path) -> set[str]:
    """Anchors of the page's headings (outside code blocks)."""
    out, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _links() -> list[tuple[Path, str]]:
    """(page, target) of every relative markdown link."""
    return [(page, m.group(1)) for page in [*PAGES, *RESULTS] for m in LINK.finditer(_prose(page))
            if not re.match(r"^[a-z]+:", m.group(1))]


def test_pages_exist() -> None:
    """The guides the README's "where to go next" table points at are there."""
    names = {p.name for p in DOCS}
    for name in ("planner.md", "simulator.md", "runtime.md", "bad_links.md",
                 "fault_tolerance.md", "emulator.md", "nat.md", "measure_and_explain.md",
                 "formats.md", "benchmarks.md", "not_done.md", "ARCHITECTURE.md"):
        assert name in names, f"docs/{name} is missing"


@pytest.mark.parametrize(("page", "target"), _links(),
                         ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_resolves(page: Path, target: str) -> None:
    """A relative link names a file that exists, and its #anchor a heading of that file."""
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), (
            f"{page.relative_to(ROOT)}: link to {target}: no heading with that anchor in "
            f"{dest.relative_to(ROOT)}")


def test_every_repo_path_named_exists() -> None:
    """`modules/x.py`-style paths in the text name files or folders of this checkout."""
    missing = []
    for page in [*PAGES, *RESULTS]:
        for m in REPO_PATH.finditer(_prose(page)):
            path = m.group(1).rstrip(".,:;")
            if PLACEHOLDER.search(path) or not path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_readme_is_an_entry_page_linking_every_guide() -> None:
    """README.md stays short and links every guide under docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = {t.partition("#")[0] for page, t in _links() if page.name == "README.md"}
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in targets]
    assert not unlinked, f"guides not linked from README.md: {unlinked}"


def test_runtime_guide_holds_the_tested_diloco_example() -> None:
    """docs/runtime.md shows the DiLoCoOptimizer example tests/test_diloco_optimizer.py runs."""
    src = (ROOT / "tests/test_diloco_optimizer.py").read_text(encoding="utf-8")
    example = re.search(r'README_EXAMPLE = """\\\n(.*?)"""', src, re.S)
    assert example, "tests/test_diloco_optimizer.py no longer holds README_EXAMPLE"
    assert example.group(1) in (ROOT / "docs/runtime.md").read_text(encoding="utf-8")


def _commands() -> list[tuple[str, str | None]]:
    """(script, subcommand or None) of every `python X.py [SUB]` the pages show."""
    found: set[tuple[str, str | None]] = set()
    for page in PAGES:
        for m in COMMAND.finditer(_prose(page)):
            if (ROOT / m.group(1)).is_file():
                found.add((m.group(1), m.group(2)))
    return sorted(found, key=lambda c: (c[0], c[1] or ""))


def test_commands_found() -> None:
    """The scan sees the entry points users run (guards the regex)."""
    scripts = {s for s, _ in _commands()}
    assert {"scheduler/scheduler.py", "dist_runner.py", "scripts/launch_local.py",
            "benchmarks/end_to_end.py"} <= scripts
    assert ("scheduler/scheduler.py", "explain") in _commands()
    assert set(_commands()) >= FLAGS_DOCUMENTED


@pytest.fixture(scope="module")
def help_texts() -> dict[str, list]:
    """What every command's `--help` prints, from one interpreter (testkit/help_texts.py:
    one torch import instead of one per command)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "testkit/help_texts.py"), json.dumps(_commands())]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize(("script", "sub"), _commands(), ids=lambda v: v or "-")
def test_command_parses_help(script: str, sub: str | None, help_texts) -> None:
    """`python SCRIPT [SUB] --help` exits 0 with a usage line: the command still parses; for
    the main entry points every flag it lists is mentioned in the README or a guide."""
    status, out, err = help_texts[f"{script} {sub or ''}"]
    assert status == 0 and "usage" in out.lower(), (
        f"{script} {sub or ''} --help: exit {status}\n{out[-800:]}{err[-800:]}")
    if (script, sub) in FLAGS_DOCUMENTED:
        text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
        missing = [f for f in HELP_FLAG.findall(out)
                   if f != "--help" and not re.search(re.escape(f) + r"(?![\w-])", text)]
        assert not missing, f"{script} {sub or ''}: flags no guide mentions: {missing}"


def test_a_fresh_interpreter_prints_the_same_help() -> None:
    """The one-interpreter shortcut prints what `python SCRIPT --help` does (checked on the
    runner, whose --help imports the most)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    fresh = subprocess.run([sys.executable, "dist_runner.py", "--help"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    batch = subprocess.run([sys.executable, str(ROOT / "testkit/help_texts.py"),
                            json.dumps([["dist_runner.py", None]])], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert json.loads(batch.stdout)["dist_runner.py "] == [0, fresh.stdout, fresh.stderr]
