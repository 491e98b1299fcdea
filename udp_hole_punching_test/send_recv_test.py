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

--backend gloo runs on CPU. --backend cupy_nccl sends CUDA buffers with cupy's NCCL bindings
(one GPU per rank; the NCCL unique id goes through the torch.distributed TCP store).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from formats.errors import UserError  # noqa: E402

LATENCY_BYTES = 4


def payload(size_bytes: int, seed: int) -> torch.Tensor:
    """The seeded byte pattern both ranks can regenerate."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size_bytes,), dtype=torch.uint8, generator=gen)


class GlooLink:
    """send/recv of uint8 CPU tensors through the default gloo process group."""

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Blocking send."""
        dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Blocking receive into t."""
        dist.recv(t, src)

    def buffer(self, n: int) -> torch.Tensor:
        """A zeroed buffer of n bytes."""
        return torch.zeros(n, dtype=torch.uint8)

    def zero(self, t: torch.Tensor) -> None:
        """Overwrite the buffer with zeros."""
        t.zero_()

    def to_cpu(self, t) -> torch.Tensor:
        """A CPU tensor with the buffer's bytes."""
        return t

    def from_cpu(self, t: torch.Tensor):
        """A transfer buffer holding t's bytes."""
        return t


class CupyNcclLink:
    """send/recv of cupy uint8 arrays through a cupy NCCL communicator."""

    @staticmethod
    def require():
        """Import cupy and its NCCL bindings, or raise UserError saying what is missing."""
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as exc:
            raise UserError(
                "--backend cupy_nccl needs cupy (pip install cupy-cuda12x) and a CUDA GPU; "
                "use --backend gloo on CPU"
            ) from exc
        if not cupy.cuda.is_available():
            raise UserError(
                "--backend cupy_nccl: cupy is installed but no CUDA device is usable here; "
                "use --backend gloo on CPU"
            )
        return cupy, nccl

    def __init__(self, rank: int, world_size: int) -> None:
        cupy, nccl = self.require()
        self.cp, self.nccl = cupy, nccl
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        uid = torch.zeros(128, dtype=torch.uint8)  # NCCL unique ids are 128 bytes
        if rank == 0:
            uid = torch.tensor([b % 256 for b in nccl.get_unique_id()], dtype=torch.uint8)
        dist.broadcast(uid, 0)
        uid_tuple = tuple(int(b) if b < 128 else int(b) - 256 for b in uid.tolist())
        self.comm = nccl.NcclCommunicator(world_size, uid_tuple, rank)
        self.stream = cupy.cuda.Stream.null

    def send(self, t, dst: int) -> None:
        """Send and wait for completion."""
        self.comm.send(t.data.ptr, t.size, self.nccl.NCCL_UINT8, dst, self.stream.ptr)
        self.stream.synchronize()

    def recv(self, t, src: int) -> None:
        """Receive and wait for completion."""
        self.comm.recv(t.data.ptr, t.size, self.nccl.NCCL_UINT8, src, self.stream.ptr)
        self.stream.synchronize()

    def buffer(self, n: int):
        """A zeroed device buffer of n bytes."""
        return self.cp.zeros(n, dtype=self.cp.uint8)

    def zero(self, t) -> None:
        """Overwrite the buffer with zeros."""
        t.fill(0)
        self.stream.synchronize()

    def to_cpu(self, t) -> torch.Tensor:
        """A CPU tensor with the buffer's bytes."""
        return torch.from_numpy(self.cp.asnumpy(t))

    def from_cpu(self, t: torch.Tensor):
        """A device buffer holding t's bytes."""
        return self.cp.asarray(t.numpy())


def run(args: argparse.Namespace) -> dict | None:
    """Run the benchmark on this rank; rank 0 returns the results."""
    torch.set_num_threads(1)
    if args.backend == "cupy_nccl":
        CupyNcclLink.require()  # fail before waiting for the other rank
    dist.init_process_group(
        "gloo",
        init_method=args.dist_url,
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout_s),
    )
    try:
        link = GlooLink() if args.backend == "gloo" else CupyNcclLink(args.rank, args.world_size)
        size = int(args.size_mb * 1e6)
        expected = payload(size, args.seed)
        data = link.from_cpu(expected) if args.rank == 0 else link.buffer(size)
        ones = torch.ones(LATENCY_BYTES, dtype=torch.uint8)
        small, ack, verdict = link.buffer(LATENCY_BYTES), link.buffer(1), link.buffer(1)
        if args.rank == 0:
            small = link.from_cpu(ones)
        lat_rtts, big_rtts = [], []
        verified = True
        for i in range(args.warmup + args.iters):
            for msg, rtts in ((small, lat_rtts), (data, big_rtts)):
                t0 = time.perf_counter()
                if args.rank == 0:
                    link.send(msg, 1)
                    link.recv(ack, 1)
                else:
                    link.recv(msg, 0)
                    link.send(ack, 0)
                if i >= args.warmup:
                    rtts.append(time.perf_counter() - t0)
            # untimed: rank 1 checks this round's bytes and zeroes its buffers for the next one
            # while rank 0 waits for the verdict, so checking never lands in a timed round trip
            if args.rank == 0:
                link.recv(verdict, 1)
                verified = verified and int(link.to_cpu(verdict)[0]) == 1
            else:
                good = torch.equal(link.to_cpu(small), ones)
                good = good and torch.equal(link.to_cpu(data), expected)
                link.zero(small)
                link.zero(data)
                link.send(link.from_cpu(torch.tensor([int(good)], dtype=torch.uint8)), 0)
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
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dist-url", required=True, help="tcp://HOST:PORT of rank 0")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int, required=True, choices=[0, 1])
    ap.add_argument("--backend", choices=["gloo", "cupy_nccl"], default="gloo")
    ap.add_argument("--size-mb", type=float, default=4.0, help="message size, MB (1e6 bytes)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the payload pattern")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    try:
        if args.world_size != 2:
            raise UserError(f"--world-size {args.world_size}: this benchmark uses exactly 2")
        if not args.dist_url.startswith("tcp://"):
            raise UserError(f"--dist-url {args.dist_url!r} must look like tcp://HOST:PORT")
        if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0:
            raise UserError("--size-mb must be > 0, --iters >= 1, --warmup >= 0")
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
    sys.exit(main())
