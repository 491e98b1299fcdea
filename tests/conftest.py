"""Shared test helpers: the repo root on sys.path, and how to run an entry point."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


SHAPED_RATE_FLOOR = 0.7
"""Lowest fraction of a shaped link's configured rate a measurement may read and still pass:
on a loaded 2-core host the probe itself competes for CPU (CI read 0.78-0.85 through the
delay line). The upper bounds (1.02-1.2x) are what show the shaping works; 0.7 still tells
40 from 120 Mbit/s."""


def run_entry(script: str, *args: str, timeout: float = 120,
              **kwargs) -> subprocess.CompletedProcess:
    """Run `python <script> args...` from the repo root, capturing text output."""
    return subprocess.run([sys.executable, str(ROOT / script), *args],
                          cwd=kwargs.pop("cwd", ROOT), capture_output=True, text=True,
                          timeout=timeout, **kwargs)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test gets this process's signal handlers back as they were: an entry point run
    in-process may leave SIGTERM ignored, and every process a later test starts would inherit
    that (terminate() then stops nothing; four files of tests failed so in CI)."""
    before = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
