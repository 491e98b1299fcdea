"""Fault injection for tests: hidden `dist_runner.py --debug-*` flags (modules.config's
RunConfig holds a DebugConfig; the flags are declared like every other setting)."""

from __future__ import annotations

from dataclasses import dataclass

from formats.errors import UserError
from formats.settings import setting


def _rank_spec(text: str, flag: str, parts: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(":")]
    except ValueError:
        values = []
    if not 2 <= len(values) <= parts or min(values) < 0:
        raise UserError(f"{flag}: expected RANK:STEP{'[:STATUS]' if parts > 2 else ''}, "
                        f"got {text!r}")
    return values


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests (hidden from --help)."""

    vanish: str = setting("", flag="--debug-vanish", hidden=True)
    """RANK:STEP[:STATUS]: that rank exits at once before STEP, like a lost peer"""
    ckpt_die: str = setting("", flag="--debug-ckpt-die", hidden=True)
    """RANK:STEP: SIGKILL that rank when its checkpoint of STEP is half written"""
    ckpt_fail: str = setting("", flag="--debug-ckpt-fail", hidden=True)
    """RANK:STEP: that rank's checkpoint writes of STEP and later fail (an I/O error)"""

    def __post_init__(self) -> None:
        # parsed once (frozen: set past __setattr__; not fields, so neither flags nor compared)
        for name, flag, parts in (("vanish", "--debug-vanish", 3),
                                  ("ckpt_die", "--debug-ckpt-die", 2),
                                  ("ckpt_fail", "--debug-ckpt-fail", 2)):
            text = getattr(self, name)
            object.__setattr__(self, f"_{name}", _rank_spec(text, flag, parts) if text else None)

    def vanish_at(self, rank: int) -> tuple[int, int]:
        """(step, exit status) at which `rank` vanishes; (0, 0): never."""
        who, step, *status = self._vanish or (-1, 0)  # type: ignore[attr-defined]
        return (step, status[0] if status else 0) if who == rank else (0, 0)

    def ckpt_die_at(self, rank: int) -> int:
        """Step whose checkpoint write kills `rank` half-way; 0: never."""
        who, step = self._ckpt_die or (-1, 0)  # type: ignore[attr-defined]
        return step if who == rank else 0

    def ckpt_fail_at(self, rank: int) -> int:
        """First step whose checkpoint writes fail on `rank`; 0: never."""
        who, step = self._ckpt_fail or (-1, 0)  # type: ignore[attr-defined]
        return step if who == rank else 0
