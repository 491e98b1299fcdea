"""Helpers (no tests): real OpenSSH servers for tests, generated keys, cleanup by pid."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def sshd_missing() -> str | None:
    """Why a real sshd cannot be started here, or None."""
    if not Path(SSHD).exists():
        return "sshd not installed (Debian openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen missing (Debian openssh-client)"
    if os.geteuid() != 0:
        return "needs root (sshd logs in as root with a test key; /run/sshd)"
    return None


def keygen(path: Path, key_type: str = "ed25519") -> Path:
    """A fresh key pair (ed25519 unless key_type says e.g. rsa) at path / path.pub."""
    subprocess.run(["ssh-keygen", "-q", "-t", key_type, "-N", "", "-C", "test", "-f",
                    str(path)], check=True, capture_output=True)
    return path


def _drain(stream) -> None:  # type: ignore[no-untyped-def]
    for _ in iter(stream.readline, b""):
        pass


def free_port(addr: str) -> int:
    """A currently free TCP port on addr."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@dataclass
class Sshd:
    """One running sshd."""

    addr: str
    port: int
    host_key: Path
    proc: subprocess.Popen

    def stop(self) -> None:
        """Terminate this sshd (by its pid) and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sshd(workdir: Path, addr: str, authorized_keys: Path,
               exec_prefix: list[str] | None = None, port: int | None = None,
               key_type: str = "ed25519") -> Sshd:
    """Start `sshd -D -e` on addr:port with its own (only) host key of key_type; waits for
    `Server listening`."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    port = port or free_port(addr)
    key = keygen(workdir / f"host_key_{addr}_{port}", key_type)
    cfg = workdir / f"sshd_{addr}_{port}.conf"
    cfg.write_text("\n".join([
        f"ListenAddress {addr}:{port}", f"HostKey {key}", "PidFile none",
        f"AuthorizedKeysFile {authorized_keys}", "StrictModes no", "UsePAM no",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp",
        "LogLevel INFO", ""]))
    proc = subprocess.Popen([*(exec_prefix or []), SSHD, "-D", "-e", "-f", str(cfg)],
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stderr is not None
    deadline = time.monotonic() + 15
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
        if b"Server listening" in line:
            # keep reading its log so sshd never blocks on a full pipe
            threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()
            return Sshd(addr, port, key, proc)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"sshd on {addr}:{port} did not start: {seen.decode(errors='replace')}")
