"""metrics.jsonl (DESIGN.md §3): one JSON object per step, written by each replica's last stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def replica_metrics_path(path: str | Path, replica: int) -> Path:
    """PATH for replica 0; PATH with `.r{r}` before the suffix for replica r > 0."""
    path = Path(path)
    if replica == 0:
        return path
    return path.with_name(f"{path.stem}.r{replica}{path.suffix}")


class MetricsWriter:
    """Appends one flushed JSON line per record (a crash loses at most the current line)."""

    def __init__(self, path: str | Path, append: bool) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        """Append a record."""
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
