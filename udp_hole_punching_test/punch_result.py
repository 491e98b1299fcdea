"""What a peer run found out: the result record (what --result-json holds), the NAT mapping
classification, the diagnosis of a failed punch, and the report of it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from formats.atomic_io import atomic_write_json

Endpoint = tuple[str, int]


@dataclass
class PunchResult:
    """Outcome of registration + punching (also what --result-json holds)."""

    ok: bool
    peer_id: str
    local_port: int
    my_public: Endpoint | None = None
    my_public_probe: Endpoint | None = None
    other: dict[str, Any] | None = None
    endpoint: Endpoint | None = None  # the other's endpoint that carried the handshake
    path: str = ""  # "direct" (punched) or "relay" (through the server)
    rtt_ms: float | None = None
    my_mapping: str = "unknown"
    other_mapping: str = "unknown"
    diagnosis: str = ""
    hellos_received: int = 0
    rejected_datagrams: int = 0
    tunnel: dict[str, Any] = field(default_factory=dict)


def mapping_behaviour(pub: Endpoint | None, probe: Endpoint | None, priv: Endpoint | None) -> str:
    """Classify a NAT mapping from the endpoints two server ports observed for one socket."""
    if pub is None or probe is None:
        return "unknown"
    if tuple(pub) != tuple(probe):
        return "endpoint-dependent (symmetric NAT)"
    if priv is not None and tuple(pub) == tuple(priv):
        return "no NAT"
    return "endpoint-independent"


def endpoint_text(ep: Endpoint | list | None) -> str:
    """An endpoint as HOST:PORT, or "nothing"."""
    return "nothing" if ep is None else f"{ep[0]}:{ep[1]}"


def explain_failure(r: PunchResult, server_port: int, probe_port: int) -> str:
    """Explain a failed punch from what was observed (`r` classified already)."""
    sides = []
    if r.my_mapping.startswith("endpoint-dependent"):
        sides.append(
            f"this side's NAT changes the public port per destination: server port "
            f"{server_port} saw {endpoint_text(r.my_public)}, port {probe_port} saw "
            f"{endpoint_text(r.my_public_probe)}"
        )
    if r.other_mapping.startswith("endpoint-dependent") and r.other:
        sides.append(
            f"the other side's NAT changes the public port per destination: "
            f"{endpoint_text(r.other['pub'])} vs {endpoint_text(r.other['pub_probe'])}"
        )
    if sides:
        return (
            "punching failed: symmetric NAT (endpoint-dependent mapping) detected; "
            + "; ".join(sides)
            + ". The port the other peer punches towards is not the one this NAT uses for "
            "it. Use a relay, or a NAT with endpoint-independent mapping."
        )
    heard = (
        f"{r.hellos_received} authenticated hello(s) arrived from the other peer but none "
        "echoed ours"
        if r.hellos_received
        else "no authenticated hello arrived from the other peer"
    )
    return (
        f"punching failed: {heard}; mappings: this side {r.my_mapping}, other side "
        f"{r.other_mapping}. Likely causes: a NAT box that accepts unsolicited WAN input "
        "and re-mapped our port for this one destination (a conntrack clash; keep "
        "--low-ttl on), a firewall that filters even solicited UDP, the other peer stopped, "
        f"or different tokens on the two peers ({r.rejected_datagrams} datagram(s) "
        "rejected)."
    )


def report(result: PunchResult, path: Path | None) -> None:
    """Print the result as one JSON line; also write it to `path` if given."""
    line = json.dumps(asdict(result))
    print(line, flush=True)
    if path is not None:
        atomic_write_json(path, asdict(result))
