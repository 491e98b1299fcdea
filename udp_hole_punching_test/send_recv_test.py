"""torch.distributed send/recv benchmark between two ranks, e.g. across the WireGuard tunnel.

    # rank 0 on the peer of role a (interface wg<hash>-a, tunnel address A), rank 1 on the other:
    GLOO_SOCKET_IFNAME=wgXXXXXXXX-a python udp_hole_punching_test/send_recv_test.py \\
        --dist-url tcp://A:29500 --world-size 2 --rank 0 --size-mb 4 --iters 5

Rank 0 sends a message of --size-mb MB to rank 1, which answers with a one-element
acknowledgement; rank 0 times each round trip. Latency is the median round trip of a 4-byte
message, halved; bandwidth is size / (round trip - latency round trip). The payload is a seeded
pseudo-random byte pattern that rank 1 checks byte for byte after every round (warm-up
included; its buffers are zeroed in between, so a lost message cannot pass on stale bytes) and
reports to rank 0 outside the timed part; a corrupted transfer fails the run (exit 1). Rank 0
prints one JSON line with the results.

Both ranks talk through the runtime's communicators (modules.comm): --backend gloo runs on CPU,
--backend cupy_nccl sends CUDA buffers with cupy's NCCL bindings (one GPU per rank; the NCCL
unique id goes through the rendezvous TCP store). Every wait is bounded by --timeout-s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

from formats import argtypes  # noqa: E402
from formats.addresses import resolve, tcp_url  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402

if TYPE_CHECKING:  # torch is imported once the flags are checked: a bad flag fails fast
    import torch

    from modules.comm import Communicator

LATENCY_BYTES = 4
MAX_SIZE_MB = 65536.0
"""Largest message (64 GB): each rank holds two of them."""
MAX_ROUNDS = 10 ** 6
MAX_SECONDS = 1e6


def payload(size_bytes: int, seed: int) -> torch.Tensor:
    """The seeded byte pattern both ranks can regenerate."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size_bytes,), dtype=torch.uint8, generator=gen)


def require_cuda_nccl() -> None:
    """UserError saying what is missing when cupy's NCCL or a CUDA device is not there."""
    import torch

    from modules.comm.nccl import cupy_package, load_nccl

    try:
        load_nccl()
    except RuntimeError as exc:
        raise UserError(f"--backend cupy_nccl needs cupy with NCCL (pip install {cupy_package()}) "
                        f"and a CUDA GPU; use --backend gloo on CPU ({exc})") from None
    if not torch.cuda.is_available():
        raise UserError("--backend cupy_nccl: cupy is installed but no CUDA device is usable "
                        "here; use --backend gloo on CPU")


def open_communicator(args: argparse.Namespace) -> Communicator:
    """Rendezvous at --dist-url, then the pair's communicator (NCCL: its unique id goes through
    the rendezvous store)."""
    import torch

    from modules.comm import CupyNcclCommunicator, GlooCommunicator
    from modules.control.dist import rendezvous

    store = rendezvous(args.dist_url, args.rank, args.world_size, args.timeout_s)
    if args.backend == "gloo":
        return GlooCommunicator(None, args.timeout_s)
    device = torch.device("cuda", args.rank % torch.cuda.device_count())
    return CupyNcclCommunicator(range(args.world_size), args.rank, store, "send-recv", device,
                                args.timeout_s)


def round_trips(comm: Communicator, args: argparse.Namespace, expected: torch.Tensor,
                ) -> tuple[list[float], list[float], bool]:
    """Timed round trips (latency-sized, then payload-sized) and whether rank 1 got every byte."""
    import torch

    dev, rank = comm.device, args.rank
    ones = torch.ones(LATENCY_BYTES, dtype=torch.uint8)
    data = expected.to(dev) if rank == 0 else torch.zeros(expected.numel(), dtype=torch.uint8,
                                                           device=dev)
    small = ones.to(dev) if rank == 0 else torch.zeros(LATENCY_BYTES, dtype=torch.uint8,
                                                       device=dev)
    ack, verdict = (torch.zeros(1, dtype=torch.uint8, device=dev) for _ in range(2))
    lat_rtts: list[float] = []
    big_rtts: list[float] = []
    verified = True
    for i in range(args.warmup + args.iters):
        for msg, rtts in ((small, lat_rtts), (data, big_rtts)):
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(msg, 1, what="payload")
                comm.recv(ack, 1, what="acknowledgement")
            else:
                comm.recv(msg, 0, what="payload")
                comm.send(ack, 0, what="acknowledgement")
            comm.synchronize()
            if i >= args.warmup:
                rtts.append(time.perf_counter() - t0)
        # untimed: rank 1 checks this round's bytes and zeroes its buffers for the next one
        # while rank 0 waits for the verdict, so checking never lands in a timed round trip
        if rank == 0:
            comm.recv(verdict, 1, what="verdict")
            verified = verified and int(verdict.cpu()[0]) == 1
        else:
            good = torch.equal(small.cpu(), ones) and torch.equal(data.cpu(), expected)
            small.zero_()
            data.zero_()
            comm.send(torch.tensor([int(good)], dtype=torch.uint8, device=dev), 0, what="verdict")
        comm.synchronize()
    return lat_rtts, big_rtts, verified


def run(args: argparse.Namespace) -> dict | None:
    """Run the benchmark on this rank; rank 0 returns the results."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.backend == "cupy_nccl":
        require_cuda_nccl()  # fail before waiting for the other rank
    comm = open_communicator(args)
    try:
        size = int(args.size_mb * 1e6)
        lat_rtts, big_rtts, verified = round_trips(comm, args, payload(size, args.seed))
        if args.rank != 0:
            return None
        lat_rtt = statistics.median(lat_rtts)
        big_rtt = statistics.median(big_rtts)
        transfer_s = max(big_rtt - lat_rtt, 1e-9)
        return {
            "backend": args.backend,
            "size_mb": args.size_mb,
            "iters": args.iters,
            "verified": verified,
            "latency_ms": round(lat_rtt / 2 * 1e3, 3),
            "rtt_ms": round(lat_rtt * 1e3, 3),
            "transfer_ms": round(big_rtt * 1e3, 3),
            "bandwidth_mbit_s": round(size * 8 / transfer_s / 1e6, 1),
        }
    finally:
        comm.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist-url", required=True, help="tcp://HOST:PORT of rank 0")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int, required=True, choices=[0, 1])
    ap.add_argument("--backend", choices=["gloo", "cupy_nccl"], default="gloo")
    ap.add_argument("--size-mb", type=argtypes.number(0, MAX_SIZE_MB, lo_open=True), default=4.0,
                    help="message size, MB (1e6 bytes)")
    ap.add_argument("--iters", type=argtypes.integer(1, MAX_ROUNDS), default=5)
    ap.add_argument("--warmup", type=argtypes.integer(0, MAX_ROUNDS), default=1)
    ap.add_argument("--seed", type=argtypes.integer(0, 2 ** 63 - 1), default=0,
                    help="seed of the payload pattern")
    ap.add_argument("--timeout-s", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                    default=60.0)
    args = ap.parse_args(argv)
    try:
        if args.world_size != 2:
            raise UserError(f"--world-size {args.world_size}: this benchmark uses exactly 2")
        resolve(tcp_url(args.dist_url, "--dist-url")[0], "--dist-url")
        result = run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RuntimeError as exc:
        print(f"error: rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result), flush=True)
        if not result["verified"]:
            print("error: rank 1 received different bytes", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    run_main(main)
