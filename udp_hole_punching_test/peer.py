"""Peer: register at the rendezvous server, punch a UDP hole to the other peer, then tunnel.

    python udp_hole_punching_test/peer.py --server HOST:PORT --session NAME --token T

Steps: (1) register on the server's port and probe its port+1 from the same socket, learning
our public endpoint as seen from two destinations and the other peer's endpoints and WireGuard
key (which the other peer authenticated with `wgmac`); (2) send authenticated hellos to the
other's public and private endpoints at once, with back-off, until each side has received a
hello that echoes one of its own fresh nonces (a two-way exchange that a spoofed or replayed
packet cannot fake); (3) close the socket and bring up WireGuard on the same local port, the
other's confirmed endpoint as its peer endpoint, and keep-alives holding both NAT mappings
open; it stays up until SIGINT/SIGTERM or --hold-s.

Exit status: 0 success, 2 user error, 3 punching failed (the diagnosis names the NAT
behaviour that was observed), 4 the tunnel did not come up, 128 + the signal number when
SIGTERM/SIGINT stopped it before the tunnel was up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from formats import argtypes  # noqa: E402
from formats.addresses import host_port, resolve  # noqa: E402
from formats.atomic_io import check_output_path  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from udp_hole_punching_test.peer_tunnel import EXIT_TUNNEL_FAILED, bring_up_tunnel  # noqa: E402
from udp_hole_punching_test.protocol import ProtocolError, SessionKeys, derive_keys  # noqa: E402
from udp_hole_punching_test.punch_result import endpoint_text, report  # noqa: E402
from udp_hole_punching_test.puncher import PeerConfig, Puncher, PunchFailed  # noqa: E402

EXIT_PUNCH_FAILED = 3
MAX_SECONDS = 1e6
"""Longest timeout or hold time a flag may give (11 days)."""


class Stopped(BaseException):
    """SIGTERM/SIGINT before the tunnel was up (a BaseException: `except Exception` lets it by)."""


def _raise_stopped(signum: int, _frame: Any) -> None:
    """Signal handler until the tunnel is up: unwind, so that every `finally` cleans up."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
    raise Stopped(signum)


def build_parser() -> argparse.ArgumentParser:
    """The peer's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="rendezvous server HOST:PORT")
    ap.add_argument("--session", required=True, help="session name shared by the two peers")
    ap.add_argument(
        "--token",
        default=os.environ.get("PUNCH_TOKEN"),
        help="secret shared by the two peers (default: $PUNCH_TOKEN, which keeps it out of ps)",
    )
    ap.add_argument("--local-port", type=int, default=0, help="UDP port to punch from (0: any)")
    ap.add_argument("--private-ip", type=argtypes.ipv4, default=None,
                    help="LAN address to announce (default: auto)")
    ap.add_argument("--register-timeout-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                    default=30.0)
    ap.add_argument("--punch-timeout-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                    default=15.0)
    ap.add_argument(
        "--low-ttl",
        type=int,
        default=2,
        help="TTL of the hellos sent in the first second of punching (or until the other's first "
        "hello arrives), which open our NAT's mapping without reaching the other NAT (0: off)",
    )
    ap.add_argument(
        "--relay-fallback",
        action="store_true",
        help="if punching fails, tunnel through the server's relay (server: --relay-mbit-s)",
    )
    ap.add_argument("--no-wireguard", action="store_true", help="punch and report only")
    ap.add_argument("--hold-s", type=argtypes.number(0, MAX_SECONDS), default=0.0,
                    help="tunnel lifetime (0: until signal)")
    ap.add_argument("--result-json", type=Path, default=None, help="also write the result here")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s peer %(message)s",
    )
    # from the start: a signal while registering or punching must still delete the private key
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stopped)
    keypair = None
    puncher = None
    try:
        try:
            cfg, keys = _config(args)
            if not args.no_wireguard:
                from udp_hole_punching_test.wireguard import KeyPair

                keypair = KeyPair.generate()
                cfg.wg_public_key = keypair.public_key
            puncher = Puncher(cfg, keys)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        return _run(args, cfg, puncher, keypair)
    except Stopped as exc:
        signum = exc.args[0]
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if puncher is not None:
            puncher.close()
        if keypair is not None:
            keypair.destroy()


def _config(args: argparse.Namespace) -> tuple[PeerConfig, SessionKeys]:
    """Check the command line; raise UserError saying what is wrong."""
    if not args.token:
        raise UserError("give the session's secret with --token T or PUNCH_TOKEN=T")
    if not 0 <= args.local_port <= 65535:
        raise UserError(f"--local-port {args.local_port} must be 0-65535")
    if not 0 <= args.low_ttl <= 255:
        raise UserError(f"--low-ttl {args.low_ttl} must be 0-255")
    if args.result_json is not None:
        check_output_path(args.result_json, "--result-json")
    host, port = host_port(args.server, "--server")
    if ":" in host:  # the peer's sockets, the hole and the tunnel are IPv4
        raise UserError(f"--server {args.server}: the peer speaks IPv4 only; give the "
                        "server's IPv4 address or a name with an A record")
    server = (resolve(host, "--server"), port)  # resolved once: the address every probe uses
    try:
        keys = derive_keys(args.token, args.session)
    except ProtocolError as exc:
        raise UserError(f"--session/--token: {exc}") from exc
    cfg = PeerConfig(
        server=server,
        session=args.session,
        token=args.token,
        local_port=args.local_port,
        private_ip=args.private_ip,
        register_timeout_s=args.register_timeout_s,
        punch_timeout_s=args.punch_timeout_s,
        low_ttl=args.low_ttl,
        relay_fallback=args.relay_fallback,
    )
    return cfg, keys


def _run(args: argparse.Namespace, cfg: PeerConfig, puncher: Puncher, keypair: Any) -> int:
    """Register, punch (or relay), then report or bring up the tunnel; return the exit status."""
    print(
        f"peer {puncher.peer_id}: local port {puncher.local_port}, private "
        f"{endpoint_text(puncher.priv)}, server {endpoint_text(cfg.server)}",
        flush=True,
    )
    try:
        puncher.register()
        assert puncher.other is not None
        print(
            f"registered: public {endpoint_text(puncher.result.my_public)} (probe "
            f"{endpoint_text(puncher.result.my_public_probe)}); other peer "
            f"{puncher.other.peer_id} public {endpoint_text(puncher.other.pub)} private "
            f"{endpoint_text(puncher.other.priv)}",
            flush=True,
        )
        try:
            puncher.punch()
        except PunchFailed as exc:
            if not cfg.relay_fallback:
                raise
            puncher.classify()
            puncher.result.diagnosis = str(exc)
            print(f"warning: {exc}\nfalling back to the server's relay", flush=True)
            puncher.relay()
    except PunchFailed as exc:
        puncher.classify()
        puncher.result.diagnosis = "; ".join(d for d in (puncher.result.diagnosis, str(exc)) if d)
        report(puncher.result, args.result_json)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PUNCH_FAILED
    r = puncher.result
    if r.path == "direct":
        print(
            f"punched: direct path to {endpoint_text(r.endpoint)} from local port {r.local_port}, "
            f"rtt {r.rtt_ms:.2f} ms; NAT mapping here {r.my_mapping}, there {r.other_mapping}",
            flush=True,
        )
    else:
        print(f"relayed: through {endpoint_text(r.endpoint)} from local port {r.local_port}",
              flush=True)
    if keypair is None:
        report(r, args.result_json)
        return 0
    try:
        return bring_up_tunnel(cfg, puncher, keypair, args.hold_s, args.result_json)
    except (RuntimeError, UserError) as exc:
        print(f"error: tunnel: {exc}", file=sys.stderr)
        return EXIT_TUNNEL_FAILED


if __name__ == "__main__":
    run_main(main)
