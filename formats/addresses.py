"""Addresses from flags: `HOST:PORT`, `tcp://HOST:PORT`, and resolving a host name, each with a
UserError naming the flag.

Resolution failures come in several shapes (socket.gaierror, and UnicodeError for a name
such as `a..b` that the IDNA codec rejects before any lookup); resolve() turns all of them
into one message.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from formats import checks
from formats.errors import UserError

MAX_HOST_CHARS = 253
"""Longest DNS name."""


def host_port(text: str, where: str, zero_ok: bool = False) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT` -> (host, port); port 1..65535 (0 too when `zero_ok`)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isascii() or not port.isdigit() or len(port) > 5:
        raise UserError(f"{where}: expected HOST:PORT, got {checks.shown(text)}")
    return check_host(host, where), checks.port(int(port), f"{where}: port", zero_ok)


def tcp_url(text: str, where: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port), port 1..65535."""
    try:
        u = urlsplit(text)
    except ValueError:  # e.g. an unclosed [IPv6 bracket
        u = urlsplit("")
    if u.scheme != "tcp" or u.path or u.query or u.fragment or not u.netloc:
        raise UserError(f"{where}: expected tcp://HOST:PORT, got {checks.shown(text)}")
    return host_port(u.netloc, where)


def check_host(host: str, where: str) -> str:
    """A host name or address literal: 1-253 characters, no whitespace or control characters."""
    checks.text(host, f"{where}: host", max_chars=MAX_HOST_CHARS)
    if any(c.isspace() for c in host):
        raise UserError(f"{where}: host {checks.shown(host)} contains whitespace")
    return host


def resolve(host: str, where: str, family: int = socket.AF_INET) -> str:
    """The first address `host` resolves to (AF_INET: an IPv4 address); UserError naming
    `where` when it does not resolve."""
    check_host(host, where)
    try:
        infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UserError(f"{where}: host {checks.shown(host)} does not resolve ({reason})") \
            from None
    return str(infos[0][4][0])
