"""Network-namespace hosts on one machine: a bridge, one veth pair per host, a state file.

Host i is namespace `{prefix}-{i}` with interface `eth0` at 198.18.0.{i+1}/24 (198.18.0.0/15 is
reserved for benchmarking, RFC 2544; used only inside these namespaces) and `lo` up. Its veth
peer `{prefix}-v{i}` sits in the root namespace on bridge `{prefix}-br` (no address in the root
namespace). Every object is recorded in the state file BEFORE it is created, so `down` also
cleans up after a crash half-way through `up` by removing exactly what the file lists, and stops
the delay-line processes it recorded (by pid, checked against /proc/PID/cmdline). Only without a
(readable) state file does `down` fall back to the exact naming pattern of the prefix
(namespaces `{prefix}-N`, links `{prefix}-br`, `{prefix}-vN`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from formats.atomic_io import atomic_write_json
from formats.errors import UserError
from scripts.netemu.shell import READY_LINE, READY_TIMEOUT_S, pid_alive, sh

STATE_DIR = Path(os.environ.get("NETEMU_STATE_DIR", "/run/scattered-netemu"))
SUBNET_PREFIX = "198.18.0."
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
MAX_HOSTS = 250
IFACE = "eth0"


def check_prefix(prefix: str, flag: str = "--prefix") -> str:
    """Validate a prefix: 1-10 lowercase letters/digits (interface names are <= 15 chars)."""
    if not PREFIX_RE.fullmatch(prefix):
        raise UserError(f"{flag}: {prefix!r} must be 1-10 lowercase letters/digits starting "
                        "with a letter (Linux interface names are limited to 15 characters)")
    return prefix


def address(i: int) -> str:
    """Address of host i."""
    return f"{SUBNET_PREFIX}{i + 1}"


def state_path(prefix: str) -> Path:
    """Where the state of prefix's cluster lives."""
    return STATE_DIR / f"{prefix}.json"


@dataclass
class NetnsState:
    """What `up` created (recorded before creation) and what runs in it."""

    prefix: str
    num_hosts: int = 0
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    delay_pids: dict[str, int] = field(default_factory=dict)
    sshd_pids: dict[str, int] = field(default_factory=dict)
    """`up --sshd`: the sshd of each namespace (scripts/netemu/sshd.py)."""
    delay_mode: str = "none"
    """`netem`, `delay-line`, `none` (no latency asked) or `not-applied: REASON`."""
    cluster_file: str = ""
    out_dir: str = ""
    group_by: str = "modulo"
    groups: list[list[int]] = field(default_factory=list)
    """Cluster device ids held by each host."""
    link_gbps: float = 100.0

    def save(self) -> None:
        """Write the state atomically."""
        atomic_write_json(state_path(self.prefix), asdict(self))

    def namespace(self, i: int) -> str:
        """Namespace name of host i."""
        return f"{self.prefix}-{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command in host i."""
        return ["ip", "netns", "exec", self.namespace(i)]


def load_state(prefix: str) -> NetnsState:
    """The state of a running local cluster; UserError when there is none."""
    path = state_path(check_prefix(prefix))
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no local cluster with prefix {prefix!r} ({path} missing); "
                        "start one with `local_cluster.py up`") from None
    return NetnsState(**obj)


def _existing_namespaces() -> set[str]:
    out = sh(["ip", "netns", "list"], check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _existing_links() -> set[str]:
    out = sh(["ip", "-o", "link", "show"], check=False).stdout
    return {m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[:@]", out, re.M)}


DEFAULT_MTU = 1500
"""The hosts' MTU unless told otherwise: the internet's."""
MIN_MTU, MAX_MTU = 1280, 65535
"""IPv6's minimum (so every stack works) .. what a veth accepts."""


def create(prefix: str, num_hosts: int, mtu: int = DEFAULT_MTU) -> NetnsState:
    """Create the bridge and `num_hosts` namespace hosts (interfaces at `mtu` bytes); on failure
    everything is removed."""
    check_prefix(prefix)
    if not 1 <= num_hosts <= MAX_HOSTS:
        raise UserError(f"--hosts: must be 1..{MAX_HOSTS}, got {num_hosts}")
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise UserError(f"--mtu: must be {MIN_MTU}..{MAX_MTU} bytes, got {mtu}")
    if state_path(prefix).exists():
        raise UserError(f"a local cluster with prefix {prefix!r} is already up "
                        f"({state_path(prefix)}); run `local_cluster.py down --prefix {prefix}` "
                        "or pick another --prefix")
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+|br|v\d+)$")
    clash = sorted(n for n in _existing_namespaces() | _existing_links() if pat.match(n))
    if clash:
        raise UserError(f"objects named like prefix {prefix!r} already exist ({clash[:3]}); "
                        f"run `local_cluster.py down --prefix {prefix}` first")
    st = NetnsState(prefix, num_hosts)
    try:
        bridge = f"{prefix}-br"
        st.links.append(bridge)
        st.save()
        sh(["ip", "link", "add", bridge, "type", "bridge"])
        sh(["ip", "link", "set", bridge, "up"])
        for i in range(num_hosts):
            ns, veth = st.namespace(i), f"{prefix}-v{i}"
            st.namespaces.append(ns)
            st.links.append(veth)
            st.save()
            sh(["ip", "netns", "add", ns])
            sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", ns])
            sh(["ip", "link", "set", veth, "mtu", str(mtu), "master", bridge])
            sh(["ip", "link", "set", veth, "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", IFACE])
            sh(["ip", "-n", ns, "link", "set", IFACE, "mtu", str(mtu), "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
    except BaseException:
        destroy(prefix)
        raise
    return st


def stop_delay_lines(st: NetnsState, timeout_s: float = 5.0) -> list[str]:
    """SIGTERM the recorded delay-line pids (only if still ours) and wait; returns notes."""
    notes = []
    for ns, pid in list(st.delay_pids.items()):
        if pid_alive(pid, "delay_line.py"):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while pid_alive(pid, "delay_line.py") and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.05)  # polling a process we cannot wait() on (not our child)
            if pid_alive(pid, "delay_line.py"):
                os.kill(pid, signal.SIGKILL)
                notes.append(f"delay line {pid} in {ns} did not stop on SIGTERM; killed")
        st.delay_pids.pop(ns)
    return notes


def stop_sshds(st: NetnsState) -> list[str]:
    """SIGTERM the recorded sshd pids (only if still sshd); returns what was stopped."""
    stopped = []
    for ns, pid in list(st.sshd_pids.items()):
        if pid_alive(pid, "sshd"):
            os.kill(pid, signal.SIGTERM)
            stopped.append(f"sshd {pid} in {ns}")
        st.sshd_pids.pop(ns)
    return stopped


def _reap(pid: int) -> None:
    # Not our child when an earlier command started it: then init reaps it.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def destroy(prefix: str) -> list[str]:
    """Remove what the state file of `prefix` lists; without a readable one, every object named
    exactly like the prefix's (after a crash that lost the file). Idempotent."""
    check_prefix(prefix)
    path = state_path(prefix)
    removed: list[str] = []
    st = None
    if path.exists():
        try:
            st = NetnsState(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            removed.append(f"(ignored unreadable state file {path})")
    if st is not None:
        # Every object is recorded before it is created: the state file is the whole list,
        # and a look-alike made by someone else (e.g. `PREFIX-7` by hand) is not ours.
        removed += stop_delay_lines(st) + stop_sshds(st)
        namespaces, links = set(st.namespaces), set(st.links)
    else:
        pat = re.compile(rf"^{re.escape(prefix)}-(\d+|br|v\d+)$")
        namespaces = {n for n in _existing_namespaces() if pat.match(n)}
        links = {n for n in _existing_links() if pat.match(n)}
    for ns in sorted(namespaces):
        if sh(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
    present = _existing_links()
    for link in sorted(links):
        if link in present and sh(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(f"link {link}")
    path.unlink(missing_ok=True)
    return removed


def start_in_namespace(st: NetnsState, i: int, argv: list[str], log: Path,
                       ready_timeout_s: float = READY_TIMEOUT_S) -> subprocess.Popen:
    """Start argv in host i's namespace, detached; wait for its `ready` line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as errf:
        proc = subprocess.Popen([*st.exec_prefix(i), *argv], stdout=subprocess.PIPE,
                                stderr=errf, start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
    line = proc.stdout.readline().decode().strip() if ready else ""
    proc.stdout.close()
    if line != READY_LINE:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise UserError(f"{argv[1] if len(argv) > 1 else argv[0]} in {st.namespace(i)} did not "
                        f"start: {' | '.join(tail) or 'no output'}")
    return proc
