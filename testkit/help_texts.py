"""What `python SCRIPT [SUB] --help` prints, for many commands in one interpreter.

tests/test_docs_links.py checks every command the guides show (44 of them): a fresh interpreter
per command imported torch 44 times, about 6 minutes of the suite on a loaded machine. Each
script runs here as `__main__` (runpy, as `python SCRIPT` runs it) with its own argv; what it
printed and its exit status are reported as one JSON object on stdout:
{"SCRIPT SUB": [status, stdout, stderr]} (status: the exit code, or the exception's name and
message when the script raised instead of exiting).

`run_script` is the same for any argv, for tests that check a command's output and exit
status without a fresh interpreter each (tests/test_cli_planner.py)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys
import traceback


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` in this interpreter (runpy, as `__main__`): its exit status
    (an exception that escaped: 1, its traceback on stderr, as Python would print it), and
    what it wrote to stdout and stderr. `script`: a path, relative to the working directory."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - reported like the interpreter would
            traceback.print_exc()
            status = 1
    sys.argv, sys.path[:] = saved
    return subprocess.CompletedProcess([script, *args], status, out.getvalue(), err.getvalue())


def help_text(script: str, sub: str | None) -> list:
    """[status, stdout, stderr] of `python SCRIPT [SUB] --help`."""
    r = run_script(script, *([sub] if sub else []), "--help")
    status: int | str = r.returncode
    if status == 1 and "Traceback" in r.stderr:  # the exception's last line for the test
        status = r.stderr.strip().splitlines()[-1]
    return [status, r.stdout, r.stderr]


def main() -> None:
    """argv[1]: a JSON list of [script, sub or null]; scripts relative to the working dir."""
    commands = json.loads(sys.argv[1])
    result = {f"{script} {sub or ''}": help_text(script, sub) for script, sub in commands}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
