"""Wire protocol of the rendezvous server and the peers: versioned JSON datagrams with an HMAC.

Every datagram is one JSON object of at most MAX_DATAGRAM_BYTES bytes with the fields
`v` (version), `t` (type), `s` (session), `id` (sender's peer id), `n` (fresh nonce),
`ts` (sender's unix time) and `mac` (HMAC-SHA256, hex, over the canonical JSON of all other
fields). Unknown types, unknown or missing fields and wrong value types are rejected, so a
receiver never acts on anything it did not validate completely.

Keys. A token shared by the two peers is stretched twice with PBKDF2:
- with a fixed salt into the *server master*, from which HMAC derives each session's *server
  key*, which authenticates peer <-> server messages (a server pinning the token stretches it
  once at start-up, so unknown session names cost it one HMAC, not one PBKDF2);
- salted with the session name into the session's master, from which HMAC derives the *peer
  key*, which authenticates everything peer <-> peer and never leaves the peers.
Knowing a server key does not give the peer key, so neither the server nor anyone who learns
the server key can forge a hello (and so redirect a peer) or swap a WireGuard public key: each
registration carries `wgmac` = HMAC(peer key, session|id|wg), which the other peer checks before
it uses the key the server forwards, and each hello carries sha256 of the sender's key. What
the server key does allow is disruption: refusing or garbling the introduction.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_DATAGRAM_BYTES = 1200  # below every path MTU we care about, so nothing fragments
MAX_TOKEN_CHARS = 256
PBKDF2_ITERATIONS = 100_000  # slows offline guessing of weak tokens from a captured datagram
MAX_TS = 2**53  # beyond any clock; bounds JSON integers before float arithmetic on them
SESSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
PEER_ID_RE = re.compile(r"^[0-9a-f]{16}$")
NONCE_RE = re.compile(r"^[0-9a-f]{32}$")
MAC_RE = re.compile(r"^[0-9a-f]{64}$")
WG_KEY_RE = re.compile(r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$")  # 32 bytes in base64

COMMON_FIELDS = ("v", "t", "s", "id", "n", "ts", "mac")


class ProtocolError(ValueError):
    """A datagram that is malformed, too big, of an unknown kind or wrongly authenticated."""


@dataclass(frozen=True)
class SessionKeys:
    """The two keys of one session, derived from its token."""

    server_key: bytes
    peer_key: bytes


def validate_session(session: str) -> str:
    """Return `session` if it is a valid session name, else raise ProtocolError."""
    if not isinstance(session, str) or not SESSION_RE.match(session):
        raise ProtocolError(
            f"session name {session!r} is invalid: use 1-64 characters from A-Z a-z 0-9 . _ -"
        )
    return session


def _stretch(token: str, salt: str) -> bytes:
    if not isinstance(token, str) or not 1 <= len(token) <= MAX_TOKEN_CHARS:
        raise ProtocolError(f"token must be 1-{MAX_TOKEN_CHARS} characters")
    return hashlib.pbkdf2_hmac("sha256", token.encode(), salt.encode(), PBKDF2_ITERATIONS, 32)


def server_master(token: str) -> bytes:
    """PBKDF2 of the token with a fixed salt; the server keys of all sessions derive from it."""
    # "/" cannot occur in a session name, so this salt never equals a session's salt below
    return _stretch(token, f"udp-hole-punch/{VERSION}/server")


def server_key(master: bytes, session: str) -> bytes:
    """The server key of one session: one HMAC of the server master."""
    return hmac.new(master, f"server|{session}".encode(), hashlib.sha256).digest()


def derive_keys(token: str, session: str) -> SessionKeys:
    """Derive a session's server key and its peer key (salted with the session name)."""
    validate_session(session)
    master = _stretch(token, f"udp-hole-punch/{VERSION}|{session}")
    peer_key = hmac.new(master, b"peer", hashlib.sha256).digest()
    return SessionKeys(server_key=server_key(server_master(token), session), peer_key=peer_key)


def wg_mac(peer_key: bytes, session: str, peer_id: str, wg: str) -> str:
    """HMAC (peer key) binding a WireGuard public key to its peer; the server cannot forge it."""
    return hmac.new(peer_key, f"wg|{session}|{peer_id}|{wg}".encode(), hashlib.sha256).hexdigest()


def wg_hash(wg: str) -> str:
    """sha256 (hex) of a WireGuard public key, which hellos carry instead of the key."""
    return hashlib.sha256(wg.encode()).hexdigest()


def new_nonce() -> str:
    """A fresh random 128-bit nonce, hex."""
    return os.urandom(16).hex()


def new_peer_id() -> str:
    """A random 64-bit peer id, hex; one per peer process."""
    return os.urandom(8).hex()


# ---------------------------------------------------------------- field validators


def _endpoint(value: Any) -> tuple[str, int]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ProtocolError("endpoint must be [ip, port]")
    ip, port = value
    if not isinstance(ip, str) or len(ip) > 45:
        raise ProtocolError("endpoint ip must be a string")
    try:
        ipaddress.ip_address(ip)
    except ValueError as exc:
        raise ProtocolError(f"endpoint ip {ip!r} is not an IP address") from exc
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ProtocolError("endpoint port must be an integer 1-65535")
    return ip, port


def _optional_endpoint(value: Any) -> tuple[str, int] | None:
    return None if value is None else _endpoint(value)


def _regex(rx: re.Pattern[str], what: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not rx.match(value):
            raise ProtocolError(f"{what} is malformed")
        return value

    return check


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("flag must be true or false")
    return value


def _echo(value: Any) -> str:
    if value == "":
        return value
    return _regex(NONCE_RE, "echo nonce")(value)


def _reason(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 200:
        raise ProtocolError("reason must be a short string")
    return value


_peer_id = _regex(PEER_ID_RE, "peer id")
_wg_key = _regex(WG_KEY_RE, "WireGuard public key")
_key_hex = _regex(MAC_RE, "server key")
_hex256 = _regex(MAC_RE, "sha256 hex digest")

_OTHER_FIELDS: dict[str, Callable[[Any], Any]] = {
    "id": _peer_id,
    "pub": _endpoint,
    "pub_probe": _optional_endpoint,
    "priv": _endpoint,
    "wg": _wg_key,
    "wgmac": _hex256,
}


def _other(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(_OTHER_FIELDS):
        raise ProtocolError(f"'other' must have exactly the fields {sorted(_OTHER_FIELDS)}")
    return {k: check(value[k]) for k, check in _OTHER_FIELDS.items()}


# type -> (required fields, optional fields), besides COMMON_FIELDS
SCHEMAS: dict[str, tuple[dict[str, Callable[[Any], Any]], dict[str, Callable[[Any], Any]]]] = {
    # peer -> server: register (to the main port) or probe (to the probe port)
    # (skey: open mode only, see Registry; wgmac = wg_mac(), checked by the other peer only)
    "reg": (
        {"priv": _endpoint, "wg": _wg_key, "wgmac": _hex256, "probe": _bool},
        {"skey": _key_hex},
    ),
    # server -> peer: what the server saw
    "reg_ok": ({"pub": _endpoint, "probe": _bool}, {}),
    # server -> peer: the other peer's endpoints, key and wgmac
    "peer": ({"pub": _endpoint, "other": _other}, {}),
    # server -> peer: an authenticated refusal
    "err": ({"reason": _reason}, {}),
    # peer -> server relay port: relay my traffic to the other peer (after punching failed)
    "relay": ({}, {}),
    # server -> peer: the relay saw us at `pub`; ready = the other peer is bound too
    "relay_ok": ({"pub": _endpoint, "ready": _bool}, {}),
    # peer -> peer: handshake (echo = last nonce received from the other; done = I confirmed;
    # wgh = wg_hash of my WireGuard key: endpoints that are not the peer learn no key)
    "hello": ({"to": _peer_id, "echo": _echo, "done": _bool, "wgh": _hex256}, {}),
}


def _canonical(msg: dict[str, Any]) -> bytes:
    body = {k: v for k, v in msg.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def compute_mac(key: bytes, msg: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) of the canonical JSON of `msg` without its `mac` field."""
    return hmac.new(key, _canonical(msg), hashlib.sha256).hexdigest()


def encode(
    key: bytes,
    mtype: str,
    session: str,
    peer_id: str,
    now: float | None = None,
    nonce: str | None = None,
    **fields: Any,
) -> bytes:
    """Build, validate and sign one datagram; raise ProtocolError if it would be invalid."""
    msg: dict[str, Any] = {
        "v": VERSION,
        "t": mtype,
        "s": session,
        "id": peer_id,
        "n": new_nonce() if nonce is None else nonce,
        "ts": round(time.time() if now is None else now, 3),
        **fields,
    }
    msg["mac"] = compute_mac(key, msg)
    data = json.dumps(msg, separators=(",", ":")).encode()
    parse(data)  # never send what a receiver would reject
    return data


def parse(data: bytes) -> dict[str, Any]:
    """Check size, JSON syntax and the schema of one datagram (not its MAC); return it."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise ProtocolError(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM_BYTES}")
    try:
        msg = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # ValueError: also bad UTF-8, huge numbers
        raise ProtocolError("datagram is not UTF-8 JSON") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("datagram is not a JSON object")
    if msg.get("v") != VERSION or isinstance(msg.get("v"), bool):
        raise ProtocolError(f"unsupported protocol version {msg.get('v')!r}")
    mtype = msg.get("t")
    if not isinstance(mtype, str) or mtype not in SCHEMAS:
        raise ProtocolError(f"unknown message type {mtype!r}")
    required, optional = SCHEMAS[mtype]
    missing = [k for k in (*COMMON_FIELDS, *required) if k not in msg]
    if missing:
        raise ProtocolError(f"{mtype}: missing fields {missing}")
    unknown = set(msg) - set(COMMON_FIELDS) - set(required) - set(optional)
    if unknown:
        raise ProtocolError(f"{mtype}: unknown fields {sorted(unknown)}")
    if not isinstance(msg["s"], str) or not SESSION_RE.match(msg["s"]):
        raise ProtocolError("session name is malformed")
    _peer_id(msg["id"])
    _regex(NONCE_RE, "nonce")(msg["n"])
    ts = msg["ts"]
    # compared, not converted: a 400-digit JSON integer would overflow a float (OverflowError);
    # NaN and infinities fail the comparison too
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not abs(ts) <= MAX_TS:
        raise ProtocolError(f"ts must be a number of at most {MAX_TS}")
    _regex(MAC_RE, "mac")(msg["mac"])
    for name, check in {**required, **optional}.items():
        if name in msg:
            check(msg[name])
    return msg


def verify(key: bytes, msg: dict[str, Any]) -> None:
    """Raise ProtocolError unless the MAC of a parsed message matches `key`."""
    if not hmac.compare_digest(compute_mac(key, msg), msg["mac"]):
        raise ProtocolError("bad MAC (wrong token or tampered datagram)")
