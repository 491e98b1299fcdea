"""Config dataclasses <-> argparse: each field becomes one flag whose help is the field's
docstring, so a setting's name, type, default and help are written once (in modules/config.py).

    add_flags(parser, RunConfig)          # --steps, --lr, --ckpt-dir, ... (nested configs too)
    cfg = from_args(RunConfig, parser.parse_args())
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, TypeVar

from formats import argtypes
from modules.config import LaunchConfig, RunConfig, flag_of

T = TypeVar("T")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring written under it} for a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field's type hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, hint
        return args[0], True
    return hint, False


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of config class `cls` (and of the configs nested in it), in an
    argument group titled by the class's docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(" ".join((cls.__doc__ or cls.__name__).split()).rstrip("."))
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if _is_config(hint):
            add_flags(parser, hint)
            continue
        kind, _ = _base_type(hint)
        flag = flag_of(cls, f.name)
        help_text = argparse.SUPPRESS if f.metadata.get("hidden") else docs.get(f.name, "")
        kwargs: dict[str, Any] = {"dest": f"{cls.__name__}.{f.name}", "help": help_text}
        if kind is bool:
            group.add_argument(flag, action="store_true", **kwargs)
            continue
        if f.metadata.get("required") or f.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
            if kwargs["help"] is not argparse.SUPPRESS and f.default not in (None, "", False):
                kwargs["help"] += f" (default {f.default})"
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        else:
            kwargs["metavar"] = f.name.upper()
        number = argtypes.number() if kind is float else argtypes.integer() if kind is int \
            else kind  # finite floats only; the fields' own checks give the ranges
        group.add_argument(flag, type=number, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build config class `cls` (nested configs included) from what add_flags parsed."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        values[f.name] = (from_args(hint, args) if _is_config(hint)
                          else getattr(args, f"{cls.__name__}.{f.name}"))
    return cls(**values)


def runner_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """dist_runner.py's parser: one flag per field of LaunchConfig and RunConfig (also used by
    the launcher to check the flags it passes on before starting any rank)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run one rank (= device id) of a plan: its pipeline stage of its replica.")
    add_flags(p, LaunchConfig)
    add_flags(p, RunConfig)
    return p
