"""Shared test helpers: the repo root on sys.path, and how to run an entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_entry(script: str, *args: str, timeout: float = 120,
              **kwargs) -> subprocess.CompletedProcess:
    """Run `python <script> args...` from the repo root, capturing text output."""
    return subprocess.run([sys.executable, str(ROOT / script), *args],
                          cwd=kwargs.pop("cwd", ROOT), capture_output=True, text=True,
                          timeout=timeout, **kwargs)
