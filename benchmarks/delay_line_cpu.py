"""What the userspace delay line costs in CPU per byte, by MTU, side by side.

Without sch_netem the lab delays packets with scripts/delay_line.py (NFQUEUE: a Python callback
per packet) on the same cores as the ranks. This sends the same bytes through it at several
MTUs (two namespaces joined by a veth pair, the delay line in the receiver) and prints the
delay line's CPU seconds per MB and the throughput, with ratios to the first MTU. Needs root,
`ip`, iptables and the NetfilterQueue package.

    python benchmarks/delay_line_cpu.py [--mb 200] [--mtus 1500,9000,65000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats.errors import UserError, run_main  # noqa: E402
from testkit.lab_network import netns_unavailable, process_cpu_s  # noqa: E402

A, B, ADDR_A, ADDR_B, PORT = "dlca", "dlcb", "198.18.9.1", "198.18.9.2", 5001
RECV = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
        "socket.SO_REUSEADDR,1);s.bind((sys.argv[1],int(sys.argv[2])));s.listen(1)\n"
        "print('ready',flush=True);c,_=s.accept()\nwhile c.recv(1<<20):pass\n")
SEND = ("import socket,sys\ns=socket.create_connection((sys.argv[1],int(sys.argv[2])))\n"
        "b=b'x'*(1<<20)\nfor _ in range(int(sys.argv[3])):s.sendall(b)\ns.close()\n")


def ip(*args: str) -> None:
    """Run `ip ARGS`, raising on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True)


def pair(mtu: int) -> None:
    """Namespaces A and B joined by a veth pair at `mtu`."""
    for ns in (A, B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        ip("netns", "add", ns)
    ip("link", "add", "dlc0", "type", "veth", "peer", "name", "dlc1")
    for ns, dev, addr in ((A, "dlc0", ADDR_A), (B, "dlc1", ADDR_B)):
        ip("link", "set", dev, "netns", ns)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "mtu", str(mtu), "up")


def measure(mtu: int, mb: int) -> tuple[float, float]:
    """(delay line CPU s per MB, MB/s) for `mb` MB sent from A to B at `mtu`."""
    pair(mtu)
    inns = ["ip", "netns", "exec", B]
    dl = subprocess.Popen([*inns, sys.executable, str(ROOT / "scripts/delay_line.py"),
                           "--delays", f'{{"{ADDR_A}": 5}}', "--queue", "4999",
                           "--tag", "dlc-bench"], stdout=subprocess.PIPE, text=True)
    rx = subprocess.Popen([*inns, sys.executable, "-c", RECV, ADDR_B, str(PORT)],
                          stdout=subprocess.PIPE, text=True)
    try:
        for proc in (dl, rx):
            if proc.stdout.readline().strip() != "ready":
                raise UserError(f"mtu {mtu}: a helper process did not start")
        before, t0 = process_cpu_s(dl.pid), time.monotonic()
        subprocess.run(["ip", "netns", "exec", A, sys.executable, "-c", SEND, ADDR_B,
                        str(PORT), str(mb)], check=True)
        rx.wait(timeout=600)
        wall, used = time.monotonic() - t0, process_cpu_s(dl.pid) - before
    finally:
        for proc in (rx, dl):
            proc.terminate()
            proc.wait(timeout=30)
        for ns in (A, B):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return used / mb, mb / wall


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=200, help="MB to send per MTU (200)")
    p.add_argument("--mtus", default="1500,9000,65000", help="comma-separated MTUs")
    args = p.parse_args(argv)
    if netns_unavailable():
        raise UserError(f"needs network namespaces: {netns_unavailable()}")
    rows = [(int(m), *measure(int(m), args.mb)) for m in args.mtus.split(",")]
    print("| MTU | delay line CPU ms/MB | vs first | MB/s | vs first |\n|---|---|---|---|---|")
    for mtu, per_mb, rate in rows:
        print(f"| {mtu} | {per_mb * 1e3:.2f} | {per_mb / rows[0][1]:.2f}x | {rate:.0f} | "
              f"{rate / rows[0][2]:.2f}x |")
    return 0


if __name__ == "__main__":
    run_main(main)
