"""Reading files that come from outside (downloaded models, other tools' output) so that no
content can hang, exhaust or crash the reader, and no name in them can lead outside their folder.

Built on formats.safe_open (a regular file only, opened so a FIFO never blocks, bounded size)
and formats.jsonfile (bounded nesting, every parse failure a UserError). On top of those, JSON
read here is strict: Python's json reads `NaN`, `Infinity` and `1e999` as floats that then flow
into plans other tools cannot parse, and it turns integers of thousands of digits into huge
numbers (or a ValueError past 4,300 digits); each is refused here by the name of its field.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from formats.checks import shown
from formats.errors import UserError
from formats.jsonfile import MAX_JSON_DEPTH, json_depth, read_text

MAX_INT_DIGITS = 40
"""Longest integer accepted (no field of a model or plan needs more than 20 digits)."""
MAX_CONFIG_BYTES = 16 << 20
"""A Hugging Face config.json is a few kB; label maps of classifiers reach a few MB."""


class _Bad:
    """A value the parser met that must not be used: NaN/Infinity or an over-long integer."""

    def __init__(self, why: str) -> None:
        self.why = why


def _constant(name: str) -> _Bad:
    return _Bad(f"is {name}; give a finite number")


def _float(text: str) -> float | _Bad:
    value = float(text)
    return value if math.isfinite(value) else _Bad(f"is {text}, beyond the float range; give a "
                                                   "finite number")


def _int(text: str) -> int | _Bad:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Bad(f"is an integer of {digits} digits (at most {MAX_INT_DIGITS} accepted)")
    return int(text)


def field_name(path: tuple) -> str:
    """`a.b[2].c` for the keys and indexes leading to a value ('(top level)' for none)."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out or "(top level)"


def find_bad(obj: Any) -> tuple[str, str] | None:
    """(field, why) of the first value that is NaN, infinite or a _Bad marker; None if clean.
    Iterative, so any depth is safe."""
    todo: list[tuple[Any, tuple]] = [(obj, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, _Bad):
            return field_name(path), value.why
        if isinstance(value, float) and not math.isfinite(value):
            return field_name(path), f"is {value}; give a finite number"
        if isinstance(value, dict):
            todo.extend((v, (*path, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            todo.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value))))
    return None


def refuse_non_finite(obj: Any, where: str) -> None:
    """UserError `WHERE: FIELD is inf; ...` when anything in `obj` is NaN or infinite (what a
    file written from it would hold as NaN/Infinity, which strict JSON readers refuse)."""
    bad = find_bad(obj)
    if bad is not None:
        raise UserError(f"{where}: {bad[0]} {bad[1]}")


def strict_loads(text: str, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads refusing, as UserError naming `where` and the field: bad syntax, nesting
    deeper than `max_depth`, NaN/Infinity/1e999, integers of more than MAX_INT_DIGITS digits."""
    try:
        obj = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}: "
                        f"{e.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: nested deeper than {max_depth} levels") from None
    except ValueError as e:
        raise UserError(f"{where}: not usable JSON ({str(e).split(';')[0]})") from None
    if json_depth(obj, max_depth) > max_depth:
        raise UserError(f"{where}: nested deeper than {max_depth} levels")
    refuse_non_finite(obj, where)
    return obj


def load_strict_json(path: str | os.PathLike, what: str, max_bytes: int = MAX_CONFIG_BYTES,
                     max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON file that must be a regular file of at most `max_bytes` (a FIFO or device is
    refused, never waited on), parsed by strict_loads; every error names `what` and the file."""
    return strict_loads(read_text(path, what, max_bytes), f"{what} {path}", max_depth)


def inside_folder(folder: str | os.PathLike, name: Any, where: str) -> Path:
    """`folder/name` for a relative file name that stays inside `folder` once resolved
    (symlinks too); UserError for a non-string, empty, absolute or escaping name."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise UserError(f"{where}: expected a file name (a string), got {shown(name)}")
    if os.path.isabs(name):
        raise UserError(f"{where}: {name!r} is an absolute path; the files must be named "
                        "relative to their folder")
    base = Path(folder).resolve()
    target = (base / name).resolve()
    if target != base and base not in target.parents:
        raise UserError(f"{where}: {name!r} leads outside the folder {base}; the files must "
                        "be inside it")
    return Path(folder) / name

