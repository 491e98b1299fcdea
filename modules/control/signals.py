"""SIGTERM to one rank: act at once, even while the training thread is blocked in C code.

Python runs a signal handler only on the main thread between bytecodes, and a rank's main
thread may sit for --timeout-s inside a gloo collective. The C-level handler, however, writes
the signal number to the wakeup fd at once; a small thread reading that pipe runs the action
(the Trainer's: save an emergency checkpoint, exit 143) without waiting for the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

TERM_STATUS = 128 + signal.SIGTERM
"""Exit status after SIGTERM (as a shell reports a process it terminated)."""


def on_terminate(action: Callable[[str], None]) -> bool:
    """Run `action(reason)` in its own thread when SIGTERM arrives; False when this is not the
    main thread (signals can only be set up there) and nothing was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the work is done by the thread below
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            data = os.read(r, 64)
            if signal.SIGTERM in data:
                action("stopped by SIGTERM")
                return

    threading.Thread(target=watch, name="sigterm", daemon=True).start()
    return True
