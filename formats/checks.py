"""Checks of single values read from files or flags; each raises UserError naming the field.

A JSON file can hold anything where a number is expected: a bool (a subclass of int in Python),
a string, an integer too large for a float (10**400: float() and math.isfinite() raise
OverflowError on it), NaN or Infinity (Python's json reads them). These helpers accept only
what the field means and say `WHERE: must be ..., got VALUE` otherwise, with VALUE shortened so
that a 4,000-digit number does not flood the terminal.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from typing import Any

from formats.errors import UserError

MAX_SHOWN_CHARS = 60
"""Longest rendering of a bad value in an error message."""


def shown(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN_CHARS characters (huge numbers, long strings)."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python converts to text
        return f"<an integer of about {value.bit_length() * 0.30103:.0f} digits>"
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS - 5]}...{text[-2:]} ({len(text)} characters)"


def is_number(value: Any) -> bool:
    """True for an int or float that is not a bool (JSON's true/false are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_finite(value: Any) -> float | None:
    """`value` as a finite float, or None (not a number, NaN, infinite, or too large)."""
    if not is_number(value):
        return None
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return out if math.isfinite(out) else None


def _num(x: float) -> str:
    """An int bound in full (10**9 as 1000000000), a float one as %g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def range_text(lo: float | None, hi: float | None, lo_open: bool = False,
               hi_open: bool = False) -> str:
    """`in (0, 1]`, `>= 1`, `< 5`, or '' for bounds (None: unbounded on that side)."""
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
    return ""


def in_range(x: float, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False, hi_open: bool = False) -> bool:
    """lo <= x <= hi (strict where `*_open`); a missing bound does not limit."""
    return ((lo is None or (x > lo if lo_open else x >= lo))
            and (hi is None or (x < hi if hi_open else x <= hi)))


def finite_number(value: Any, where: str, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` as a float: a finite number (not a bool) within the bounds; UserError otherwise.

    Bounds are inclusive unless `lo_open`/`hi_open`; None means unbounded on that side.
    """
    x = as_finite(value)
    if x is None or not in_range(x, lo, hi, lo_open, hi_open):
        bounds = range_text(lo, hi, lo_open, hi_open)
        raise UserError(f"{where}: must be a finite number{' ' + bounds if bounds else ''}, "
                        f"got {shown(value)}")
    return x


def integer(value: Any, where: str, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int (not a bool, not a float such as 2.0) within [lo, hi]; UserError
    otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not in_range(value, lo, hi):
        bounds = range_text(lo, hi)
        raise UserError(f"{where}: must be an integer{' ' + bounds if bounds else ''}, "
                        f"got {shown(value)}")
    return value


def one_of(value: Any, where: str, choices: Iterable[str]) -> str:
    """`value` when it is one of the strings `choices`; UserError listing them otherwise."""
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise UserError(f"{where}: must be one of {', '.join(options)}, got {shown(value)}")
    return value


def text(value: Any, where: str, max_chars: int = 1024, empty: bool = False) -> str:
    """`value` when it is a string of at most `max_chars` characters (non-empty unless
    `empty`), without control characters (no newline, tab or NUL)."""
    if not isinstance(value, str):
        raise UserError(f"{where}: must be a string, got {shown(value)}")
    if not value and not empty:
        raise UserError(f"{where}: must not be empty")
    if len(value) > max_chars:
        raise UserError(f"{where}: longer than {max_chars} characters ({len(value)})")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UserError(f"{where}: contains a control character: {shown(value)}")
    return value


def port(value: Any, where: str, zero_ok: bool = False) -> int:
    """A TCP/UDP port 1..65535 (0 too when `zero_ok`: the kernel picks one)."""
    return integer(value, where, 0 if zero_ok else 1, 65535)


def ipv4(value: Any, where: str) -> str:
    """`value` as a dotted IPv4 address literal (names are not resolved)."""
    try:
        return str(ipaddress.IPv4Address(value))
    except (ValueError, TypeError):
        raise UserError(f"{where}: must be an IPv4 address such as 192.168.1.2, got "
                        f"{shown(value)}") from None


def interface_name(value: Any, where: str) -> str:
    """A Linux network interface name: 1-15 characters, no '/', ':', whitespace, '.' or '..'."""
    name = text(value, where, max_chars=15)
    if any(c in name for c in "/: ") or name in (".", ".."):
        raise UserError(f"{where}: {shown(name)} is not a network interface name (1-15 "
                        f"characters without '/', ':' or spaces)")
    return name
