"""Reading user files with limits: a regular file, at most so many bytes, UTF-8 text, JSON
nested at most so deep. Every problem is a UserError naming the file.

Python's json module alone turns a deeply nested file into a RecursionError, a number of more
than 4,300 digits into a ValueError that is not a JSONDecodeError, and a binary file into a
UnicodeDecodeError: tracebacks, not messages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from formats.errors import UserError
from formats.safe_open import read_bytes

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects accepted; our formats nest at most 5 levels."""
MAX_SMALL_FILE_BYTES = 64 << 20
"""Default size limit: plans, calibration files, host lists and maps are far below it."""


def json_depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` is 1), counted up to
    `limit + 1` at most (without recursion, so any depth is safe)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        todo.extend((child, depth + 1) for child in children
                    if isinstance(child, (dict, list)))
    return deepest


def parse_json(text: str, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads with every failure as UserError `where: ...` (syntax, nesting, huge ints)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: "
                        f"{e.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: nested deeper than {max_depth} levels") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise UserError(f"{where}: not usable JSON ({str(e).split(';')[0]})") from None
    if json_depth(obj, max_depth) > max_depth:
        raise UserError(f"{where}: nested deeper than {max_depth} levels")
    return obj


def read_text(path: str | os.PathLike, what: str,
              max_bytes: int = MAX_SMALL_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`; UserError `what PATH: ...`."""
    p = Path(path)
    data = read_bytes(p, what, max_bytes)  # a regular file only: a FIFO would block
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {p}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                        f"{e.start})") from None


def load_json(path: str | os.PathLike, what: str, max_bytes: int = MAX_SMALL_FILE_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON file through read_text and parse_json; errors name the file."""
    return parse_json(read_text(path, what, max_bytes), str(path), max_depth)
