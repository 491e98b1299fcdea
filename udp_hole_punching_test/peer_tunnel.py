"""The peer's last phase: WireGuard on the punched socket's port, held until a signal."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from udp_hole_punching_test.punch_result import endpoint_text, report
from udp_hole_punching_test.puncher import PeerConfig, Puncher

EXIT_TUNNEL_FAILED = 4
HANDSHAKE_TIMEOUT_S = 30.0
"""How long the WireGuard handshake through the hole may take: WireGuard retries every 5 s, and
on a loaded machine the first tries can go out before the other side's interface listens."""


def bring_up_tunnel(
    cfg: PeerConfig, puncher: Puncher, keypair: Any, hold_s: float, result_json: Path | None
) -> int:
    """Close the punched socket, start WireGuard on its port, report, hold, tear down."""
    from udp_hole_punching_test import wireguard as wg

    other = puncher.other
    assert other is not None and puncher.result.endpoint is not None
    role = "a" if puncher.peer_id < other.peer_id else "b"
    addr_a, addr_b = wg.tunnel_addresses(cfg.session)
    mine, theirs = (addr_a, addr_b) if role == "a" else (addr_b, addr_a)
    tunnel = wg.Tunnel(
        name=wg.interface_name(cfg.session, role),
        address=mine,
        peer_address=theirs,
        listen_port=puncher.local_port,
        endpoint=puncher.result.endpoint,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    puncher.close()  # WireGuard takes over the port and the NAT mapping behind it
    # `other.wg` is the key the confirmed hellos hashed (wgh) and the other peer vouched for
    # (wgmac); Puncher._from_server refuses any later change of it
    try:
        t_up = time.monotonic()
        tunnel.up(keypair, other.wg, initiate=role == "a")  # b answers (see Tunnel.up)
        t_listen = time.monotonic()
        ok = tunnel.wait_handshake(timeout_s=HANDSHAKE_TIMEOUT_S)
        if ok and role == "b":
            tunnel.keep_alive(other.wg)
        puncher.result.tunnel = tunnel_record(tunnel, ok, role, t_up, t_listen)
        if not ok:  # what WireGuard saw, for the diagnosis
            puncher.result.tunnel["wg_status"] = tunnel.status()
        report(puncher.result, result_json)
        if not ok:
            print("error: WireGuard handshake did not complete within "
                  f"{HANDSHAKE_TIMEOUT_S:g} s", file=sys.stderr)
            return EXIT_TUNNEL_FAILED
        print(
            f"tunnel up: {tunnel.name} ({tunnel.implementation}) {mine} <-> {theirs} "
            f"via {endpoint_text(tunnel.endpoint)}; holding until SIGTERM/SIGINT"
            + (f" or {hold_s:.0f} s" if hold_s > 0 else ""),
            flush=True,
        )
        stop.wait(timeout=hold_s if hold_s > 0 else None)
        return 0
    finally:
        tunnel.down()


def tunnel_record(tunnel: Any, ok: bool, role: str, t_up: float, t_listen: float
                  ) -> dict[str, Any]:
    """The result's `tunnel` entry: the interface, its addresses, and how long it took."""
    from udp_hole_punching_test import wireguard as wg

    return {
        "ok": ok,
        "interface": tunnel.name,
        "implementation": tunnel.implementation,
        "role": role,
        "address": tunnel.address,
        "peer_address": tunnel.peer_address,
        "listen_port": tunnel.listen_port,
        "endpoint": list(tunnel.endpoint),
        "keepalive_s": wg.KEEPALIVE_S,
        "up_s": round(t_listen - t_up, 3),
        "handshake_s": round(time.monotonic() - t_listen, 3),
        "wall_time": round(time.time(), 3),
    }
