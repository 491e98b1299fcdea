"""Real OpenSSH servers in namespace hosts, so the SSH workflow for real hosts (measure.py,
cluster_ssh.py, aws_run_batch.sh) can be rehearsed on one machine.

Each host gets its own ed25519 host key and an sshd on port 22 of its address that accepts only
the keys of the given authorized_keys file (root login by key; no passwords). The bridge gets
198.18.0.254/24 so that the root namespace reaches the hosts. The sshd pids are recorded in the
state file and stopped by `down` (checked against /proc/PID/cmdline, as the delay lines are).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from formats.errors import UserError
from scripts.netemu.netns import NetnsState, address
from scripts.netemu.shell import sh

SSHD = "/usr/sbin/sshd"
BRIDGE_ADDRESS = "198.18.0.254/24"
"""The root namespace's address on the hosts' bridge (for SSH from outside the hosts)."""
START_TIMEOUT_S = 15.0


def sshd_missing() -> str:
    """Why sshd cannot be started in the hosts ('' when it can)."""
    if not Path(SSHD).exists():
        return f"{SSHD} is not installed (Debian: openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is missing (Debian: openssh-client)"
    return ""


def _config(i: int, host_key: Path, authorized_keys: Path) -> str:
    return "\n".join([
        f"ListenAddress {address(i)}:22", f"HostKey {host_key}", "PidFile none",
        f"AuthorizedKeysFile {authorized_keys}", "StrictModes no", "UsePAM no",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", ""])


def start_sshds(st: NetnsState, authorized_keys: Path, work_dir: Path) -> list[str]:
    """Start one sshd per host (pids recorded in `st`); returns a line per host."""
    assert not sshd_missing() and authorized_keys.is_file()  # checked with the flags
    work_dir.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
    _claim_bridge_address(f"{st.prefix}-br")
    lines = []
    for i in range(st.num_hosts):
        key = work_dir / f"host{i}_ed25519"
        if not key.exists():
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", st.namespace(i), "-f",
                str(key)])
        cfg = work_dir / f"sshd{i}.conf"
        cfg.write_text(_config(i, key, authorized_keys.resolve()))
        st.sshd_pids[st.namespace(i)] = _start(st, i, cfg, work_dir / f"sshd{i}.log")
        st.save()
        lines.append(f"host {i}: sshd on {address(i)}:22 (pid {st.sshd_pids[st.namespace(i)]})")
    return lines


def _claim_bridge_address(bridge: str) -> None:
    """Give the bridge BRIDGE_ADDRESS, unless another local cluster's bridge has it: every
    prefix uses the same subnet, so only one can be reached from the root namespace."""
    ip = BRIDGE_ADDRESS.split("/")[0]
    for line in sh(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        dev = line.split()[1]
        if f" {ip}/" in line and dev != bridge:
            raise UserError(f"--sshd: {dev} already has {ip} (another local cluster with "
                            f"--sshd?); only one can be reached at a time: take it down first")
    sh(["ip", "addr", "replace", BRIDGE_ADDRESS, "dev", bridge])


def _start(st: NetnsState, i: int, cfg: Path, log: Path) -> int:
    """sshd -D -e in host i, detached; its pid once it says `Server listening`."""
    with open(log, "wb") as errf:
        proc = subprocess.Popen([*st.exec_prefix(i), SSHD, "-D", "-e", "-f", str(cfg)],
                                stdin=subprocess.DEVNULL, stdout=errf, stderr=errf,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if b"Server listening" in log.read_bytes():
            return proc.pid
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise UserError(f"sshd in {st.namespace(i)} did not start: {' | '.join(tail) or 'no output'}")
