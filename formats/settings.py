"""One way to declare a setting and check it: a dataclass field made with `setting(...)` carries
its range or choices (and its flag) as metadata, its docstring is its help, and from that

- `check(obj, name_of)` validates every field of a config object (UserError naming the field the
  caller's way: `--lr` for the runner, `PlanRequest.num_stages` for the planner's library);
- `problem(cls, name, value)` says what is wrong with one value (a file's key, a flag's value);
- `add_flags(group, cls, ...)` / `from_args(cls, args)` turn the fields into argparse flags and
  back, for both command lines (dist_runner.py's and scheduler.py's).

    @dataclass
    class OptimConfig:
        lr: float = setting(1e-3, lo=0.0, lo_open=True)
        \"\"\"AdamW (inner) learning rate\"\"\"

        def __post_init__(self) -> None:
            check(self, flag_of)

The wording of a problem does not name the field ("must be in (0, 1], got 2"), so every front
end names it its own way. The limits every front end shares (seconds, counts, seeds) are here.
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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from formats import argtypes, checks
from formats.errors import UserError

T = TypeVar("T")

MAX_COUNT = 10 ** 9
"""Upper bound of step counts, intervals, sizes, evaluations and samples: far beyond any run, and
small enough that no arithmetic on them overflows (torch takes 64-bit integers, timedelta and
sleep finite seconds)."""
MAX_SEED = 2 ** 63 - 1
"""Seeds are 64-bit (torch.manual_seed, numpy's default_rng take them)."""
MAX_SECONDS = 1e8
"""Longest timeout or time limit (3 years): beyond it timedelta and the store's millisecond
timeouts overflow."""

def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            flag: str | None = None, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, hi_open: bool = False, choices: Iterable[Any] | None = None,
            noun: str | None = None, hidden: bool = False, required: bool = False) -> Any:
    """A dataclass field with its rule: bounds (inclusive unless `*_open`) or allowed values;
    `flag` overrides `--field-name`; `noun` words a bad choice as `unknown NOUN 'x'; known: ...`;
    `hidden` keeps it out of --help; `required` makes its flag required."""
    meta: dict[str, Any] = {}
    for key, value in (("flag", flag), ("lo", lo), ("hi", hi), ("noun", noun)):
        if value is not None:
            meta[key] = value
    if lo_open:
        meta["lo_open"] = True
    if hi_open:
        meta["hi_open"] = True
    if choices is not None:
        meta["choices"] = tuple(choices)
    if hidden:
        meta["hidden"] = True
    if required:
        meta["required"] = True
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@functools.cache
def _module_tree(path: str) -> ast.Module:
    """A source file's syntax tree, parsed once per process (every --help string of a
    command comes from a few files: inspect.getsource parsed the whole file for each class)."""
    return ast.parse(Path(path).read_text(encoding="utf-8"))


def _class_node(cls: type) -> ast.ClassDef:
    """The class statement of `cls` in its module's source, found by its qualified name (a
    class defined in a function: from its own source)."""
    path = inspect.getsourcefile(cls)
    body: list[ast.stmt] = _module_tree(path).body if path else []
    node = None
    for name in cls.__qualname__.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
            return tree.body[0]  # type: ignore[return-value]
        body = node.body
    assert node is not None, cls
    return node


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring written under it} for a dataclass, read from its source."""
    body = _class_node(cls).body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def base_type(hint: Any) -> tuple[Any, bool]:
    """(the scalar type, whether None is allowed) of a field's type hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, hint
        return args[0], True
    return hint, False


def is_config(hint: Any) -> bool:
    """Whether a field's type is itself a config dataclass (a nested group of settings)."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _field(cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(name)


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field `name` of config class `cls`."""
    return _field(cls, name).metadata.get("flag", "--" + name.replace("_", "-"))


def qualified(cls: type, name: str) -> str:
    """`Class.field`: how a library (not a command line) names a field in its errors."""
    return f"{cls.__name__}.{name}"


def range_text(meta: dict[str, Any]) -> str:
    """`in (0, 1]`, `>= 1`, `< 5`, or '' for a field's bounds (checks.range_text)."""
    return checks.range_text(meta.get("lo"), meta.get("hi"), meta.get("lo_open", False),
                             meta.get("hi_open", False))


def _choice_problem(meta: dict[str, Any], value: Any) -> str | None:
    options = meta["choices"]
    if value in options and type(value) in {type(o) for o in options}:
        return None
    if meta.get("noun"):
        return (f"unknown {meta['noun']} {checks.shown(value)}; known: "
                f"{', '.join(map(str, options))}")
    if all(isinstance(o, int) for o in options):
        words = ", ".join(map(str, options[:-1])) + f" or {options[-1]}"
        return f"must be {words}, got {checks.shown(value)}"
    return f"must be one of {', '.join(map(str, options))}, got {checks.shown(value)}"


def _number_problem(kind: type, meta: dict[str, Any], value: Any) -> str | None:
    bounds = range_text(meta)
    lo, hi = meta.get("lo"), meta.get("hi")
    if kind is int:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
        x = value if ok_type else checks.as_finite(value)
        fits = x is not None and checks.in_range(x, lo, hi, meta.get("lo_open", False),
                                                 meta.get("hi_open", False))
        if ok_type and fits:
            return None
        if lo is not None and hi is not None:
            return f"must be {bounds}, got {checks.shown(value)}" + \
                ("" if ok_type else ", not an integer")
        return f"must be an integer{' ' + bounds if bounds else ''}, got {checks.shown(value)}"
    x = checks.as_finite(value)
    if x is not None and checks.in_range(x, lo, hi, meta.get("lo_open", False),
                                         meta.get("hi_open", False)):
        return None
    if lo is not None and hi is not None:
        return f"must be {bounds}, got {checks.shown(value)}"
    return f"must be a finite number{' ' + bounds if bounds else ''}, got {checks.shown(value)}"


def problem(cls: type, name: str, value: Any) -> str | None:
    """What is wrong with `value` for field `name` of `cls` (its type, range or choices), or
    None when it is fine; worded without the field's name."""
    f = _field(cls, name)
    kind, optional = base_type(_hints(cls)[name])
    if value is None:
        return None if optional else f"must be given, got {checks.shown(value)}"
    meta = dict(f.metadata)
    if "choices" in meta:
        return _choice_problem(meta, value)
    if kind is bool:
        return None if isinstance(value, bool) else \
            f"must be true or false, got {checks.shown(value)}"
    if kind in (int, float):
        return _number_problem(kind, meta, value)
    if kind is str and not isinstance(value, str):
        return f"must be a string, got {checks.shown(value)}"
    return None


def check(obj: Any, name_of: Callable[[type, str], str] = qualified) -> None:
    """UserError `NAME: PROBLEM` for the first field of config `obj` that breaks its rule; the
    field is named by `name_of(class, field)` (flag_of for a command line's configs)."""
    cls = type(obj)
    for f in dataclasses.fields(cls):
        if is_config(_hints(cls)[f.name]):
            continue
        bad = problem(cls, f.name, getattr(obj, f.name))
        if bad:
            raise UserError(f"{name_of(cls, f.name)}: {bad}")


def _argtype(cls: type, name: str, kind: type, bounded: bool) -> Callable[[str], Any]:
    """The argparse type of a field's flag: numbers finite (argtypes), and with `bounded` also
    within the field's rule, worded as `problem` words it."""
    if kind not in (int, float):
        return kind
    parse = argtypes.number() if kind is float else argtypes.integer()
    if not bounded:
        return parse

    def convert(text: str) -> Any:
        value = parse(text)
        bad = problem(cls, name, value)
        if bad:
            raise argparse.ArgumentTypeError(bad)
        return value
    convert.__name__ = parse.__name__  # argparse names the type in some messages
    return convert


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              names: Iterable[str] | None = None, *, defaults: dict[str, Any] | None = None,
              default_words: dict[str, str] | None = None, bounded: bool = False,
              flag_metavar: bool = False,
              help_words: Callable[[str], str] = lambda text: text) -> None:
    """One flag per field of config class `cls`: dest `Class.field`, help the field's docstring
    (through `help_words`) and its default, choices from its rule, numbers refused when not
    finite (and, with `bounded`, when they break the field's rule: argparse's own error, exit
    2).

    Without `names`: every field, configs nested in it too, each class in an argument group
    titled by its docstring. With `names`: those fields, added to `parser` (or the group) as
    given. `defaults` replaces a field's default on the command line (None: 'not given', for
    the caller to resolve); `default_words` says the default in words instead of `(default
    X)`; `flag_metavar`: the metavar is the flag's name (`--time-limit TIME_LIMIT`), not the
    field's."""
    hints, docs = _hints(cls), field_docs(cls)
    opts = {"defaults": defaults or {}, "words": default_words or {}, "bounded": bounded,
            "flag_metavar": flag_metavar}
    group = parser
    if names is None and isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(
            " ".join((cls.__doc__ or cls.__name__).split()).rstrip("."))
    for name in list(names) if names is not None else [f.name for f in dataclasses.fields(cls)]:
        f, hint = _field(cls, name), hints[name]
        if is_config(hint):
            add_flags(parser, hint, bounded=bounded, help_words=help_words)
            continue
        _add_one(group, cls, f, hint, opts, help_words(docs.get(name, "")))


def _add_one(group: Any, cls: type, f: dataclasses.Field, hint: Any, opts: dict[str, Any],
             help_text: str) -> None:
    kind, _ = base_type(hint)
    meta, flag = f.metadata, flag_of(cls, f.name)
    kwargs: dict[str, Any] = {"dest": f"{cls.__name__}.{f.name}",
                              "help": argparse.SUPPRESS if meta.get("hidden") else help_text}
    if kind is bool and "choices" not in meta:
        group.add_argument(flag, action="store_true", **kwargs)
        return
    default = opts["defaults"].get(f.name, f.default)
    if meta.get("required") or default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
        words = opts["words"].get(f.name) or \
            (f"default {default}" if default not in (None, "", False) else "")
        if kwargs["help"] is not argparse.SUPPRESS and words:
            kwargs["help"] += f" ({words})"
    if "choices" in meta:
        kwargs["choices"] = meta["choices"]
    else:
        kwargs["metavar"] = (flag.lstrip("-").replace("-", "_") if opts["flag_metavar"]
                             else f.name).upper()
    group.add_argument(flag, type=_argtype(cls, f.name, kind, opts["bounded"]), **kwargs)


def value_of(args: argparse.Namespace, cls: type, name: str) -> Any:
    """What the flag add_flags made for field `name` of `cls` parsed."""
    return getattr(args, f"{cls.__name__}.{name}")


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build config class `cls` (nested configs included) from what add_flags parsed."""
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        values[f.name] = (from_args(hint, args) if is_config(hint)
                          else value_of(args, cls, f.name))
    return cls(**values)
