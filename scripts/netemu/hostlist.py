"""The `ip_list` host list: one `user@host[:port]` per line; `#` comments, blank lines."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from formats import checks
from formats.addresses import check_host
from formats.errors import UserError
from formats.jsonfile import read_text

MAX_USER_CHARS = 32
"""Longest Linux user name (useradd's limit)."""


@dataclass(frozen=True)
class HostEntry:
    """One SSH target."""

    user: str
    host: str
    port: int = 22

    @property
    def label(self) -> str:
        """`user@host:port`, used to prefix output and in messages."""
        return f"{self.user}@{self.host}:{self.port}"

    def known_hosts_name(self) -> str:
        """Key under which OpenSSH/paramiko store this host in known_hosts."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


def parse_host_line(line: str, where: str) -> HostEntry:
    """Parse `user@host[:port]` (IPv6 as `user@[addr]:port`); `where` names the line in errors."""
    text = line.strip()
    if "@" not in text:
        raise UserError(f"{where}: expected user@host[:port], got {text!r} (the user is required)")
    user, _, hostport = text.partition("@")
    if not user or any(c.isspace() or not c.isprintable() for c in user) \
            or len(user) > MAX_USER_CHARS:
        raise UserError(f"{where}: bad user name in {checks.shown(text)} (1-{MAX_USER_CHARS} "
                        "printable characters, no spaces)")
    port = 22
    if hostport.startswith("["):
        host, sep, rest = hostport[1:].partition("]")
        if not sep:
            raise UserError(f"{where}: missing ']' in {text!r}")
        if rest:
            if not rest.startswith(":"):
                raise UserError(f"{where}: expected ':port' after ']' in {text!r}")
            port = _port(rest[1:], where, text)
    elif hostport.count(":") == 1:
        host, _, p = hostport.partition(":")
        port = _port(p, where, text)
    else:
        host = hostport
    if not host or any(c.isspace() or not c.isprintable() for c in host):
        raise UserError(f"{where}: empty or malformed host in {checks.shown(text)}")
    return HostEntry(user, check_host(host, where), port)


def _port(text: str, where: str, line: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise UserError(f"{where}: port must be 1..65535, got {checks.shown(text)} in "
                        f"{checks.shown(line)}")
    return int(text)


def load_host_list(path: str | Path) -> list[HostEntry]:
    """Read an `ip_list` file; raises UserError naming the file and line of a bad entry."""
    path = Path(path)
    lines = read_text(path, "host list").splitlines()
    hosts = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(parse_host_line(line, f"{path}:{n}"))
    if not hosts:
        raise UserError(f"{path}: no hosts (expected one user@host[:port] per line)")
    return hosts


def format_host_list(hosts: list[HostEntry], header: str = "") -> str:
    """The text of an `ip_list` file for `hosts` (with an optional `#` header line)."""
    lines = [f"# {header}"] if header else []
    for h in hosts:
        host = f"[{h.host}]" if ":" in h.host else h.host
        lines.append(f"{h.user}@{host}" + (f":{h.port}" if h.port != 22 else ""))
    return "\n".join(lines) + "\n"


def ipv4_of(host: str, where: str) -> str:
    """`host` as an IPv4 literal (u32 filters match on it); names are not resolved on purpose."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise UserError(
            f"{where}: {host!r} is not an IPv4 address; tc u32 filters match destination IPv4 "
            "addresses, so give addresses (not names) in the cluster's device.host or the "
            "host list") from None
