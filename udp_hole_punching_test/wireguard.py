"""WireGuard through the punched hole: per-session keys, interface up on the punched port, down.

Kernel WireGuard is used where `ip link add ... type wireguard` works; otherwise Debian's
userspace `wireguard-go` runs as our child process (foreground, so we own its pid). Its control
socket lives in /var/run/wireguard/NAME.sock, which all network namespaces share, so interface
names include the session hash and the peer's role and never collide between the two peers.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from formats.errors import UserError

KEEPALIVE_S = 5  # well below the 30 s UDP conntrack timeout of Linux NATs and home routers
WG_SOCKET_DIR = Path("/var/run/wireguard")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
TUNNEL_NET = ipaddress.IPv4Network("10.77.0.0/16")
TUNNEL_BLOCK_BITS = 14  # 2**14 /30 blocks: two sessions share one with odds 1 in 16384


def session_hash(session: str) -> str:
    """Short stable hash of the session name, used in interface names and tunnel addresses."""
    return hashlib.sha256(session.encode()).hexdigest()[:8]


def interface_name(session: str, role: str) -> str:
    """Interface name 'wg<hash8>-<a|b>' (12 characters, below the 15 allowed)."""
    assert role in ("a", "b")
    return f"wg{session_hash(session)}-{role}"


def tunnel_addresses(session: str) -> tuple[str, str]:
    """Tunnel IPs of role a and role b: the two hosts of a /30 in 10.77.0.0/16 (session hash)."""
    block = int(session_hash(session), 16) >> (32 - TUNNEL_BLOCK_BITS)  # top bits of 32
    base = TUNNEL_NET.network_address + 4 * block
    return str(base + 1), str(base + 2)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the peer dies, so no daemon is orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run(cmd: list[str], stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def require_tools() -> None:
    """Raise UserError naming the missing Debian package when `wg` or `ip` is absent."""
    if shutil.which("wg") is None:
        raise UserError("`wg` not found: install Debian's wireguard-tools (apt-get install ...)")
    if shutil.which("ip") is None:
        raise UserError("`ip` not found: install Debian's iproute2")


@dataclass
class KeyPair:
    """A per-session key pair; the private key stays in a 0600 file in a 0700 temp folder."""

    folder: Path
    private_key_file: Path
    public_key: str

    @classmethod
    def generate(cls) -> KeyPair:
        """Generate keys with `wg genkey` / `wg pubkey`."""
        require_tools()
        folder = Path(tempfile.mkdtemp(prefix="wg-session-"))  # mkdtemp makes it 0700
        private_file = folder / "private.key"
        fd = os.open(private_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            private = _run(["wg", "genkey"]).strip()
            f.write(private + "\n")
        public = _run(["wg", "pubkey"], stdin=private + "\n").strip()
        return cls(folder=folder, private_key_file=private_file, public_key=public)

    def destroy(self) -> None:
        """Delete the key files."""
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class Tunnel:
    """A WireGuard interface to one peer; `down` removes it and stops wireguard-go."""

    name: str
    address: str
    peer_address: str
    listen_port: int
    endpoint: tuple[str, int]
    implementation: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)

    def up(self, keys: KeyPair, peer_public_key: str, initiate: bool = True) -> None:
        """Create the interface on listen_port with the peer at `endpoint`, and bring it up.

        Only an initiating side gets its persistent keep-alive now; the other gets it from
        `keep_alive` once the handshake is done. Two sides that come up within one round trip
        of each other initiate at once, each drops the response to its own initiation, and the
        keep-alive timers (no jitter) keep them in that lock-step: seen as no handshake in 30 s.
        """
        try:
            _run(["ip", "link", "add", self.name, "type", "wireguard"])
            self.implementation = "kernel"
        except RuntimeError:
            self._start_wireguard_go()
        prefix = TUNNEL_NET.max_prefixlen - 2  # the /30 of tunnel_addresses
        _run(["ip", "address", "add", f"{self.address}/{prefix}", "dev", self.name])
        ip, port = self.endpoint
        endpoint = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        _run(
            [
                "wg", "set", self.name,
                "listen-port", str(self.listen_port),
                "private-key", str(keys.private_key_file),
                "peer", peer_public_key,
                "endpoint", endpoint,
                "allowed-ips", f"{self.peer_address}/32",
                "persistent-keepalive", str(KEEPALIVE_S if initiate else 0),
            ]
        )  # fmt: skip
        _run(["ip", "link", "set", self.name, "up"])

    def keep_alive(self, peer_public_key: str) -> None:
        """Turn on the persistent keep-alive that holds the NAT mapping open."""
        _run(["wg", "set", self.name, "peer", peer_public_key,
              "persistent-keepalive", str(KEEPALIVE_S)])

    def _start_wireguard_go(self) -> None:
        exe = shutil.which("wireguard-go")
        if exe is None:
            raise UserError(
                "no kernel WireGuard and no `wireguard-go`: install Debian's wireguard-go"
            )
        sock = WG_SOCKET_DIR / f"{self.name}.sock"
        if sock.exists():
            raise UserError(
                f"{sock} exists: another wireguard-go uses interface name {self.name} "
                "(same session and role running elsewhere on this host?)"
            )
        env = {**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"}
        self.process = subprocess.Popen(
            [exe, "-f", self.name],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self.implementation = "wireguard-go"
        deadline = time.monotonic() + 10.0
        while not sock.exists():  # the daemon creates its control socket once ready
            if self.process.poll() is not None:
                stderr = self.process.stderr
                err = stderr.read().decode(errors="replace") if stderr else ""
                raise RuntimeError(f"wireguard-go exited ({self.process.returncode}): {err}")
            if time.monotonic() > deadline:
                raise RuntimeError("wireguard-go did not create its control socket in 10 s")
            time.sleep(0.02)

    def status(self) -> dict[str, str]:
        """Latest handshake time and byte counters of the peer, from `wg show`."""
        out = _run(["wg", "show", self.name, "dump"]).strip().splitlines()
        if len(out) < 2:
            return {}
        f = out[1].split("\t")
        return {"endpoint": f[2], "latest_handshake": f[4], "rx_bytes": f[5], "tx_bytes": f[6]}

    def wait_handshake(self, timeout_s: float) -> bool:
        """Poll `wg show` until a WireGuard handshake with the peer completed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.status().get("latest_handshake", "0") != "0":
                return True
            time.sleep(0.1)
        return False

    def down(self) -> None:
        """Delete the interface and stop our wireguard-go; safe to call twice."""
        subprocess.run(["ip", "link", "del", self.name], capture_output=True, timeout=30)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.implementation == "wireguard-go":
            (WG_SOCKET_DIR / f"{self.name}.sock").unlink(missing_ok=True)
