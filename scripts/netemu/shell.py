"""Running local commands with clear errors (argv lists only, never a shell)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from formats.errors import UserError

READY_LINE = "ready"
"""What the delay line and the probe agent print on stdout once they serve."""
READY_TIMEOUT_S = 10
"""How long a starter waits for that line (locally and over SSH) before calling it failed."""


class CommandError(UserError):
    """A system command failed; the message holds the command and its stderr."""


def sh(argv: list[str], check: bool = True, timeout: float = 30.0,
       input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run argv, capture text output; raise CommandError on a non-zero exit when `check`."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              input=input_text)
    except FileNotFoundError:
        raise CommandError(f"`{argv[0]}` not found; install it (see docs/emulator.md)") from None
    if check and proc.returncode != 0:
        raise CommandError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def missing_root_tools(tools: tuple[str, ...] = ("ip", "tc")) -> str | None:
    """Why namespace hosts cannot be built here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    pkgs = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}
    for tool in tools:
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package {pkgs.get(tool, tool)})"
    return None


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" when it is gone or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def pid_alive(pid: int, must_contain: str) -> bool:
    """Whether `pid` runs and its command line contains `must_contain` (guards reused pids)."""
    return must_contain in cmdline(pid)
