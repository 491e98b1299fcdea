"""The one error type for user mistakes, and the wrapper every entry point runs under."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what to do.

    Entry points catch it, print the message without a traceback and exit with status 2.
    """

    exit_code = 2


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None,
             skip_teardown: bool = False) -> None:
    """Run an entry point: UserError -> `error: ...` on stderr and exit 2, no traceback.

    `skip_teardown`: a command that closed every file it wrote exits without the interpreter's
    teardown (stdout and stderr flushed first): freeing numpy's and scipy's modules took
    0.05-0.07 s of the planner's ~1 s on a 2-core AMD EPYC. Never for a process that still
    has threads, temporary files or atexit work to finish; not when a caller in this
    interpreter captured stdout (testkit.help_texts.run_script): it gets SystemExit."""
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except BrokenPipeError:
        # `... | head` closed stdout: not an error of ours; keep Python from complaining at exit.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        code = 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    if skip_teardown and sys.stdout is sys.__stdout__:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
                stream.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(code)
