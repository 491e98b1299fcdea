"""metrics.jsonl (see docs/formats.md): one JSON object per step and replica; the run
folder's per-rank timing files use the same writer (names: formats/run_metrics.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from formats.atomic_io import atomic_write_bytes
from formats.run_metrics import MAX_JSONL_BYTES, rank_timing_path, replica_metrics_path
from formats.safe_open import read_bytes

__all__ = ["MetricsWriter", "rank_timing_path", "read_metrics", "replica_metrics_path"]


class MetricsWriter:
    """Appends one flushed JSON line per record (a crash loses at most the current line).

    `resume_step` None starts a new file; a step keeps the records up to it and drops the later
    ones, which the crashed run wrote after its checkpoint and the resumed run writes again.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            atomic_write_bytes(self.path, _lines_up_to(self.path, resume_step))
        mode = "w" if resume_step is None else "a"
        self._f = open(self.path, mode, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        """Append a record."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file."""
    text = read_bytes(path, "metrics file", MAX_JSONL_BYTES).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _lines_up_to(path: Path, step: int) -> bytes:
    """The lines of a metrics file whose record has no step or one <= `step` (a line cut off by
    a crash is dropped)."""
    keep = []
    text = read_bytes(path, "--metrics", MAX_JSONL_BYTES).decode("utf-8", errors="replace")
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or rec["step"] <= step:
            keep.append(line + "\n")
    return "".join(keep).encode()
