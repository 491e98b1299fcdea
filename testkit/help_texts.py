"""What `python SCRIPT [SUB] --help` prints, for many commands in one interpreter.

tests/test_docs_links.py checks every command the guides show (44 of them): a fresh interpreter
per command imported torch 44 times, about 6 minutes of the suite on a loaded machine. Each
script runs here as `__main__` (runpy, as `python SCRIPT` runs it) with its own argv; what it
printed and its exit status are reported as one JSON object on stdout:
{"SCRIPT SUB": [status, stdout, stderr]} (status: the exit code, or the exception's name and
message when the script raised instead of exiting)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys


def help_text(script: str, sub: str | None) -> list:
    """[status, stdout, stderr] of `python SCRIPT [SUB] --help`."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, list(sys.path)
    sys.argv = [script, *([sub] if sub else []), "--help"]
    status: int | str = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            status = f"{type(e).__name__}: {e}"
    sys.argv, sys.path[:] = saved
    return [status, out.getvalue(), err.getvalue()]


def main() -> None:
    """argv[1]: a JSON list of [script, sub or null]; scripts relative to the working dir."""
    commands = json.loads(sys.argv[1])
    result = {f"{script} {sub or ''}": help_text(script, sub) for script, sub in commands}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
