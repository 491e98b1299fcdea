"""The one error type for user mistakes, and the wrapper every entry point runs under."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what to do.

    Entry points catch it, print the message without a traceback and exit with status 2.
    """

    exit_code = 2


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run an entry point: UserError -> `error: ...` on stderr and exit 2, no traceback."""
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # `... | head` closed stdout: not an error of ours; keep Python from complaining at exit.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        sys.exit(0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
