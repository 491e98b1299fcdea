"""argparse `type=` callables that accept only valid values, so a bad flag is argparse's own
`error: argument --flag: ...` (exit 2) before anything runs.

Plain `type=float` takes `nan`, `inf` and `1e999` (= inf); plain `type=int` takes any size.
These use the checks of formats.checks, so a flag and a file field are judged by one rule.

    p.add_argument("--rate-per-s", type=number(lo=0, lo_open=True), default=50.0)
    p.add_argument("--port", type=integer(0, 65535), default=0)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from formats import checks
from formats.errors import UserError


def _argtype(name: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except UserError as e:  # "value: must be ...": argparse puts the flag before it
            raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
    parse.__name__ = name  # argparse names the type in some messages
    return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False) -> Callable[[str], float]:
    """A finite float within the bounds (inclusive unless `*_open`)."""
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UserError(f"value: must be a number, got {checks.shown(text)}") from None
        return checks.finite_number(value, "value", lo, hi, lo_open, hi_open)
    return _argtype("number", convert)


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer within [lo, hi] (what int() reads: decimal digits, an optional sign)."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an integer, or more digits than Python converts (4300)
            raise UserError(f"value: must be an integer, got {checks.shown(text)}") from None
        return checks.integer(value, "value", lo, hi)
    return _argtype("integer", convert)


def port(zero_ok: bool = False) -> Callable[[str], int]:
    """A TCP/UDP port 1..65535 (0 too when `zero_ok`: pick a free one)."""
    return integer(0 if zero_ok else 1, 65535)


def ipv4(text: str) -> str:
    """An IPv4 address literal."""
    return _argtype("ipv4", lambda t: checks.ipv4(t, "value"))(text)


def interface_name(text: str) -> str:
    """A Linux network interface name (1-15 characters)."""
    return _argtype("interface_name", lambda t: checks.interface_name(t, "value"))(text)


def name(max_chars: int = 255) -> Callable[[str], str]:
    """A non-empty single-line string of at most `max_chars` characters."""
    return _argtype("name", lambda t: checks.text(t, "value", max_chars))
