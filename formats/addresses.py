"""Addresses from flags: `HOST:PORT`, `tcp://HOST:PORT`, resolving a host name, and hivemind
multiaddresses, each with a UserError naming the flag.

Resolution failures come in several shapes (socket.gaierror, and UnicodeError for a name
such as `a..b` that the IDNA codec rejects before any lookup); resolve() turns all of them
into one message.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
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


def parse_maddrs(text: str | Sequence[str] | None, flag: str,
                 need_peer_id: bool = True) -> list[str]:
    """Comma-separated multiaddresses, each checked; UserError naming `flag` and the bad one.
    `need_peer_id`: each must end in /p2p/<peer id> (an initial peer must)."""
    from hivemind.utils.multiaddr import Multiaddr

    items = text.split(",") if isinstance(text, str) else list(text or [])
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            addr = Multiaddr(item)
        except Exception as e:  # noqa: BLE001 - the multiaddr package raises several types
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"{flag}: {item!r} is not a multiaddress ({why}); expected e.g. "
                            "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...") from None
        if need_peer_id and "/p2p/" not in str(addr):
            raise UserError(f"{flag}: {item!r} has no /p2p/<peer id> part; copy the whole "
                            "address a replica or scripts/dht_node.py printed")
        out.append(str(addr))
    return out
