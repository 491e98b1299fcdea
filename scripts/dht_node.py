"""A bare hivemind DHT node for --outer-backend hivemind (as the seeds' `hivemind-dht`): it
trains nothing; replicas join the DHT through it, so it is the one address to hand out.

    python scripts/dht_node.py [--host-maddrs /ip4/0.0.0.0/tcp/31337] \
        [--announce-maddrs /ip4/PUBLIC_IP/tcp/31337] [--initial-peers MADDR[,MADDR]] \
        [--identity-path node.key] [--check-s 30] [--exit-after-check]
    # then every replica: python dist_runner.py ... --outer-backend hivemind \
    #                         --initial-peers <an address it printed>

It prints the addresses to pass as --initial-peers, then checks that each is reachable by
joining a second, short-lived DHT client through it (a line per address: reachable, or why
not), and runs until Ctrl+C / SIGTERM, which stop it and its p2pd cleanly. Several nodes
(each started with --initial-peers of another) keep the DHT up when one of them goes away.
Exit status: 0 stopped cleanly (or checked, with --exit-after-check, and every address was
reachable), 1 an address was unreachable with --exit-after-check, 2 bad input or the
--initial-peers could not be joined.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

# before anything imports torch: c10d's C++ stack traces stay out of our one-line errors
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from formats import argtypes  # noqa: E402
from formats.errors import run_main  # noqa: E402

DEFAULT_PORT_MADDR = "/ip4/0.0.0.0/tcp/31337"


def build_parser() -> argparse.ArgumentParser:
    """The node's flags."""
    p = argparse.ArgumentParser(description="Start a bare hivemind DHT node and print the "
                                "--initial-peers addresses the replicas of a run pass.")
    p.add_argument("--host-maddrs", default=DEFAULT_PORT_MADDR, metavar="MADDR[,MADDR]",
                   help=f"where to listen (default {DEFAULT_PORT_MADDR})")
    p.add_argument("--announce-maddrs", default=None, metavar="MADDR[,MADDR]",
                   help="addresses to announce instead (a public IP in front of a NAT)")
    p.add_argument("--initial-peers", default=None, metavar="MADDR[,MADDR]",
                   help="other DHT nodes to join (default: this is the first node)")
    p.add_argument("--identity-path", default=None, metavar="FILE",
                   help="private key file: the same peer id (and so the same addresses) on "
                   "every start; created when missing")
    p.add_argument("--check-s", type=argtypes.number(0, 3600, lo_open=True), default=30.0,
                   help="seconds to start and to check each address (default 30)")
    p.add_argument("--exit-after-check", action="store_true",
                   help="exit after the check (status 1 when an address is unreachable)")
    return p


def check_reachable(addresses: list[str], timeout_s: float) -> dict[str, str | None]:
    """Join a throw-away DHT client through each address: address -> None (reachable) or why
    not."""
    from formats.errors import UserError
    from modules.sync.hivemind_dht import start_dht

    out: dict[str, str | None] = {}
    for addr in addresses:
        try:
            probe = start_dht([addr], ["/ip4/127.0.0.1/tcp/0"], [], True, timeout_s)
        except UserError as e:
            out[addr] = str(e)
            continue
        probe.shutdown()
        out[addr] = None
    return out


def main(argv: list[str] | None = None) -> int:
    """Start the node, print its addresses, check them, serve until stopped."""
    args = build_parser().parse_args(argv)
    from formats.addresses import parse_maddrs
    from modules.sync.hivemind_dht import start_dht, visible_maddrs

    host = parse_maddrs(args.host_maddrs, "--host-maddrs", need_peer_id=False)
    announce = parse_maddrs(args.announce_maddrs, "--announce-maddrs", need_peer_id=False)
    peers = parse_maddrs(args.initial_peers, "--initial-peers")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = start_dht(peers, host, announce, False, args.check_s,
                     identity_path=args.identity_path)
    try:
        addresses = visible_maddrs(node)
        print(f"DHT node up; every replica passes --initial-peers {','.join(addresses)}",
              flush=True)
        results = check_reachable(addresses, args.check_s)
        for addr, why in results.items():
            print(f"  {addr}: " + ("reachable" if why is None else f"NOT reachable: {why}"),
                  flush=True)
        if args.exit_after_check:
            return 0 if all(why is None for why in results.values()) else 1
        print("serving; Ctrl+C or SIGTERM stops it", flush=True)
        while not stop.wait(1.0):
            pass
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        t0 = time.monotonic()
        node.shutdown()
        print(f"DHT node stopped ({time.monotonic() - t0:.1f} s)", flush=True)


def entry() -> None:
    """Console entry point (`st-dht`)."""
    run_main(main)


if __name__ == "__main__":
    entry()
