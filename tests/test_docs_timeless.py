"""The guides say what a user does and why, not when something was measured: dated lab notes
live under docs/results/ (one file per benchmark, newest first), and the guides link there.
Run as a script to list the dated lines: `python tests/test_docs_timeless.py`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDES = sorted((ROOT / "docs").glob("*.md"))
MAX_DATED_LINES = 10
"""Dated lines allowed over all of docs/*.md (a guide may say where a figure came from)."""
MAX_SENTENCE_WORDS = 60
"""The longest sentence docs/ARCHITECTURE.md may hold, in words."""

DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\btoday\b|\byesterday\b|\bthis session\b"
                   r"|\b(?:earlier|previous|last|\w+(?:st|nd|rd|th)) session\b", re.I)
LIST_ITEM = re.compile(r"^([-*]|\d+\.)\s")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(*\[])")


def dated_lines(pages: list[Path] = GUIDES) -> list[str]:
    """`page:line: text` of every line of the pages holding a date or a 'today'-like word."""
    out = []
    for page in pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if DATED.search(line):
                name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
                out.append(f"{name}:{n}: {line.strip()}")
    return out


def _paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a markdown page: code blocks, tables and headings left out."""
    paras: list[str] = []
    current: list[str] = []
    fence = False
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("```"):
            fence = not fence
        if fence or line.startswith("```") or not stripped or stripped.startswith(("|", "#")):
            paras, current = paras + [" ".join(current)] if current else paras, []
            continue
        if LIST_ITEM.match(stripped) and current:
            paras.append(" ".join(current))
            current = []
        current.append(stripped)
    if current:
        paras.append(" ".join(current))
    return paras


def long_sentences(page: Path, limit: int = MAX_SENTENCE_WORDS) -> list[str]:
    """The sentences of a page's prose longer than `limit` words (the first words of each)."""
    out = []
    for para in _paragraphs(page.read_text(encoding="utf-8")):
        for sentence in SENTENCE_END.split(para):
            words = sentence.split()
            if len(words) > limit:
                out.append(f"{len(words)} words: {' '.join(words[:12])} ...")
    return out


def test_guides_hold_few_dated_lines() -> None:
    """At most MAX_DATED_LINES lines of docs/*.md name a date or 'today': measurements go to
    docs/results/, the guides link them."""
    found = dated_lines()
    assert len(found) <= MAX_DATED_LINES, (
        f"{len(found)} dated lines in docs/*.md (at most {MAX_DATED_LINES}); move the "
        "measurement to docs/results/<benchmark>.md and link it:\n" + "\n".join(found))


def test_the_check_sees_a_dated_line(tmp_path: Path) -> None:
    """The pattern catches the forms the guides used (guards the regex)."""
    page = tmp_path / "x.md"
    page.write_text("A correction (2026-11-26).\nToday's run: 3 s.\nNo date here.\n"
                    "Since yesterday.\nIn this session.\nThe thirteenth session added it.\n",
                    encoding="utf-8")
    assert len(dated_lines([page])) == 5


def test_architecture_sentences_are_short() -> None:
    """docs/ARCHITECTURE.md reads in sentences of at most MAX_SENTENCE_WORDS words."""
    found = long_sentences(ROOT / "docs/ARCHITECTURE.md")
    assert not found, "split these sentences of docs/ARCHITECTURE.md:\n" + "\n".join(found)


def test_the_sentence_check_sees_a_long_sentence(tmp_path: Path) -> None:
    """A sentence over the limit is found, across wrapped lines; two short ones are not."""
    page = tmp_path / "x.md"
    page.write_text(" ".join(["word"] * 40) + "\n" + " ".join(["more"] * 30) + ".\n\n"
                    "Short one. Another short one.\n", encoding="utf-8")
    assert len(long_sentences(page)) == 1


if __name__ == "__main__":
    lines = dated_lines()
    print("\n".join(lines))
    print(f"{len(lines)} dated lines in docs/*.md (at most {MAX_DATED_LINES})")
    for text in long_sentences(ROOT / "docs/ARCHITECTURE.md"):
        print(f"docs/ARCHITECTURE.md: {text}")
    sys.exit(0 if len(lines) <= MAX_DATED_LINES else 1)
