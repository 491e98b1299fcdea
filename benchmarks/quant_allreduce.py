"""int8 pseudo-gradient compression, measured side by side in one run.

1. codec: quantise + dequantise throughput (GB/s of fp32 input) of our CPU path vs the plain
   vectorised torch version and a per-block loop; on a GPU (cupy present) the int8.cu kernel
   vs a device-to-device copy and the memory's theoretical peak.
2. error: absmax scaling vs +-k sigma clipping windows on gradient-like data (why absmax).
3. allreduce: mean all-reduce of a pseudo-gradient over 4 gloo ranks on loopback through the
   runtime's communicator (modules.comm), fp32 (all_reduce) vs fp16 vs int8: wall time and
   bytes sent.
4. netns: the same under an htb rate limit (default 100 Mbit/s) on every host's egress, the
   ranks in 4 network namespaces on a bridge (needs root, iproute2 and tc; skipped otherwise).

    python benchmarks/quant_allreduce.py [--mb 100] [--limited-mb 100] [--only SECTION]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from modules.comm import GlooCommunicator  # noqa: E402
from modules.quant import dequantize_int8  # noqa: E402
from modules.quant.allreduce import SEGMENT  # noqa: E402
from modules.quant.codec import quantize_int8_torch  # noqa: E402

COMPRESSIONS = ("none", "fp16", "int8")
LABEL = {"none": "fp32", "fp16": "fp16", "int8": "int8"}


def naive_vectorised(x: torch.Tensor, block: int) -> torch.Tensor:
    """The obvious vectorised round trip: full-size temporaries for every step."""
    pad = (-x.numel()) % block
    b = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    scale = (b.abs().amax(dim=1, keepdim=True) / 127).clamp(min=2**-126)
    return (torch.round(b / scale).clamp(-127, 127).to(torch.int8).float() * scale).view(-1)


def naive_loop(x: torch.Tensor, block: int) -> torch.Tensor:
    """The first thing one writes: one block at a time."""
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        b = x[lo: lo + block]
        scale = max(float(b.abs().max()) / 127, 2**-126)
        out[lo: lo + block] = torch.round(b / scale).clamp(-127, 127) * scale
    return out


def _rate(fn, x: torch.Tensor, repeats: int = 3) -> float:
    """Best GB/s of fp32 input over `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / 1e9 / best


def codec_table(mb: float, block: int) -> None:
    """CPU codec throughput side by side (and the CUDA kernel when there is a GPU)."""
    torch.set_num_threads(1)
    x = torch.randn(int(mb * 2**20 / 4))
    ours = _rate(lambda v: dequantize_int8(quantize_int8_torch(v, block)), x)
    vec = _rate(lambda v: naive_vectorised(v, block), x)
    small = x[: 1 << 18]
    loop = _rate(lambda v: naive_loop(v, block), small, 1)
    print(f"## codec: quantise + dequantise, {mb:g} MB fp32, block {block}, 1 CPU thread\n")
    print("| implementation | GB/s of fp32 input | ours / it |\n|---|---|---|")
    print(f"| ours (modules.quant, cache-sized chunks) | {ours:.2f} | 1.00 |")
    print(f"| plain vectorised torch (full-size temporaries) | {vec:.2f} | {ours / vec:.2f} |")
    print(f"| per-block Python loop (on 1 MB) | {loop:.4f} | {ours / loop:.0f} |")
    gpu_codec_table(x, block)


def gpu_codec_table(x: torch.Tensor, block: int) -> None:
    """Kernel GB/s of DRAM traffic vs a device copy and the theoretical peak."""
    if not torch.cuda.is_available():
        print("\n(no CUDA device here: the int8.cu kernel is not timed)")
        return
    try:
        import cupy
    except ImportError:
        print("\n(CUDA present but cupy missing: install the gpu extra to time the kernel)")
        return
    from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda

    xc = x.cuda()
    n = xc.numel()
    q = quantize_int8_cuda(xc, block)

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / 20

    traffic = 5 * n + 4 * n // block  # 4 B in + 1 B out per value, + a scale per block
    rows = [("quantise (int8.cu)", timed(lambda: quantize_int8_cuda(xc, block)), traffic),
            ("dequantise (int8.cu)", timed(lambda: dequantize_int8_cuda(q)), traffic),
            ("quantise (torch ops on GPU)", timed(lambda: quantize_int8_torch(xc, block)),
             traffic),
            ("device copy (torch clone)", timed(lambda: xc.clone()), 8 * n)]
    props = cupy.cuda.runtime.getDeviceProperties(xc.device.index or 0)
    clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    peak = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else float("nan")
    copy_rate = rows[-1][2] / rows[-1][1] / 1e9
    print(f"\n## CUDA codec on {torch.cuda.get_device_name()}, {n * 4 / 2**20:g} MB, block "
          f"{block} (theoretical memory peak {peak:.0f} GB/s)\n")
    print("| kernel | ms | GB/s DRAM traffic | % of peak | % of copy |\n|---|---|---|---|---|")
    for name, secs, nbytes in rows:
        rate = nbytes / secs / 1e9
        print(f"| {name} | {secs * 1e3:.3f} | {rate:.0f} | {100 * rate / peak:.0f} | "
              f"{100 * rate / copy_rate:.0f} |")


def error_table(block: int) -> None:
    """Quantisation error of absmax vs +-k sigma windows: relative RMS and max abs error."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # StudentT.sample draws from the global generator
    data = {"gaussian": torch.randn(1 << 20, generator=gen) * 1e-3,
            "student-t(3)": torch.distributions.StudentT(3.0).sample((1 << 20,)) * 1e-3}
    print(f"\n## error: absmax vs +-k sigma window, block {block}, 1M values\n")
    print("| data | scaling | RMS error / RMS | max abs error / max abs |\n|---|---|---|---|")
    for name, x in data.items():
        blocks = x.view(-1, block)
        rows = [("absmax", dequantize_int8(quantize_int8_torch(x, block)).view(-1, block))]
        for k in (2.5, 3.0, 4.0):
            window = k * blocks.std(dim=1, keepdim=True)
            scale = window / 127
            rows.append((f"{k:g} sigma", torch.round(blocks.clamp(-window, window) / scale)
                         .clamp(-127, 127) * scale))
        for scaling, y in rows:
            err = blocks - y
            rms = float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
            print(f"| {name} | {scaling} | {rms:.4f} | "
                  f"{float(err.abs().max() / x.abs().max()):.4f} |")
    print("\nabsmax keeps every value inside its window (max error = half a step); a k-sigma "
          "window has a finer step but clips the tails, which costs more than it gains here.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, addr: str, port: int, numel: int, repeats: int,
           out: str, segment: int) -> None:
    """One rank: time each payload's mean all-reduce (barrier before and after)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    comm = GlooCommunicator(None, timeout_s=600)  # the runtime's communicator, world group
    x0 = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    warm = torch.ones(1024)
    for comp in COMPRESSIONS:  # connections and code paths warm
        comm.mean_all_reduce(warm, comp)
    rows = {}
    for comp in COMPRESSIONS:
        best = (float("inf"), 0)
        for _ in range(repeats):
            x = x0.clone()
            comm.barrier()
            t = time.perf_counter()
            sent = comm.mean_all_reduce(x, comp, segment=segment)
            comm.barrier()
            best = min(best, (time.perf_counter() - t, sent))
        rows[comp] = best
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _worker_cmd(rank: int, world: int, addr: str, port: int, numel: int, repeats: int,
                out: str) -> list[str]:
    """The command line of one worker (the segment size travels in QUANT_BENCH_SEGMENT)."""
    return [sys.executable, str(Path(__file__).resolve()), "--segment",
            os.environ.get("QUANT_BENCH_SEGMENT", str(SEGMENT)), "--worker", str(rank), "--world",
            str(world), "--addr", addr, "--port", str(port), "--numel", str(numel),
            "--repeats", str(repeats), "--out", out]


def _run_workers(cmds: list[list[str]], envs: list[dict], timeout_s: float) -> None:
    procs = [subprocess.Popen(c, env=e) for c, e in zip(cmds, envs)]
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"benchmark worker exited with status {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _print_allreduce(title: str, rows: dict, note: str) -> None:
    print(f"\n## {title}\n")
    print("| payload | wall s | MB sent by rank 0 | time / fp32 | bytes / fp32 | fp32 / time |")
    print("|---|---|---|---|---|---|")
    base_t, base_b = rows["none"]
    for comp in COMPRESSIONS:
        wall, sent = rows[comp]
        print(f"| {LABEL[comp]} | {wall:.3f} | {sent / 2**20:.1f} | {wall / base_t:.3f} | "
              f"{sent / base_b:.3f} | {base_t / wall:.2f}x |")
    print(f"\n{note}")


def allreduce_table(mb: float, world: int, repeats: int) -> None:
    """fp32 vs fp16 vs int8 mean all-reduce on loopback."""
    numel = int(mb * 2**20 / 4)
    with tempfile.TemporaryDirectory() as d:
        out, port = f"{d}/rows.json", _free_port()
        _run_workers([_worker_cmd(r, world, "127.0.0.1", port, numel, repeats, out)
                      for r in range(world)], [dict(os.environ)] * world, 600)
        rows = json.loads(Path(out).read_text())
    _print_allreduce(f"mean all-reduce, {mb:g} MB fp32, {world} gloo ranks on loopback "
                     f"(best of {repeats})", rows,
                     "On loopback the wire is not the bottleneck: the codec's CPU time is.")


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def netns_table(mb: float, world: int, rate_mbit: float) -> None:
    """The same all-reduce with every host's egress limited by htb, hosts in namespaces."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        print(f"\n(rate-limited all-reduce skipped: needs root and ip/tc; root={os.geteuid() == 0}"
              f", missing={missing})")
        return
    pid = os.getpid()
    switch, hosts = f"qsw{pid}", [f"qh{pid}-{i}" for i in range(world)]
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        ifnames = [f"qv{pid}{i}"[-15:] for i in range(world)]
        for i, (ns, ifname) in enumerate(zip(hosts, ifnames)):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                "netns", switch)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"10.99.0.{i + 1}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for tc in (["qdisc", "add", "dev", ifname, "root", "handle", "1:", "htb",
                        "default", "10"],
                       ["class", "add", "dev", ifname, "parent", "1:", "classid", "1:10", "htb",
                        "rate", f"{rate_mbit:g}mbit", "ceil", f"{rate_mbit:g}mbit"]):
                r = subprocess.run(["tc", "-n", ns, *tc], capture_output=True, text=True,
                                   timeout=30)
                if r.returncode != 0:
                    raise RuntimeError(f"tc {' '.join(tc)}: {r.stderr.strip()}")
        numel = int(mb * 2**20 / 4)
        with tempfile.TemporaryDirectory() as d:
            out = f"{d}/rows.json"
            cmds = [["ip", "netns", "exec", ns,
                     *_worker_cmd(i, world, "10.99.0.1", 29500, numel, 1, out)]
                    for i, ns in enumerate(hosts)]
            envs = [dict(os.environ, GLOO_SOCKET_IFNAME=ifname) for ifname in ifnames]
            _run_workers(cmds, envs, 600)
            rows = json.loads(Path(out).read_text())
    finally:
        for ns in reversed(made):
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                               timeout=30)
            if r.returncode != 0:
                print(f"warning: could not delete namespace {ns}: {r.stderr.strip()}")
    fp32_over_int8 = rows["none"][0] / rows["int8"][0]
    _print_allreduce(f"mean all-reduce, {mb:g} MB fp32, {world} gloo ranks in network namespaces,"
                     f" htb {rate_mbit:g} Mbit/s egress per host", rows,
                     f"int8 is {fp32_over_int8:.2f}x faster than fp32 under the limit "
                     f"(target >= 3x: {'met' if fp32_over_int8 >= 3 else 'NOT met'}).")


def main() -> int:
    """Print the tables (markdown)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="pseudo-gradient MB (codec, loopback)")
    p.add_argument("--limited-mb", type=float, default=100.0,
                   help="pseudo-gradient MB under the rate limit")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="htb rate per host, Mbit/s")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="loopback repetitions (best kept)")
    p.add_argument("--segment", type=int, default=SEGMENT,
                   help=f"values per pipelined segment of the compressed all-reduce ({SEGMENT})")
    p.add_argument("--only", choices=("codec", "error", "allreduce", "netns"))
    for hidden in ("--worker", "--world", "--port", "--numel"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.world, args.addr, args.port, args.numel, args.repeats, args.out,
               args.segment)
        return 0
    if args.mb <= 0 or args.limited_mb <= 0 or args.ranks < 2 or args.rate_mbit <= 0:
        print("error: --mb, --limited-mb and --rate-mbit must be > 0 and --ranks >= 2",
              file=sys.stderr)
        return 2
    os.environ["QUANT_BENCH_SEGMENT"] = str(args.segment)  # to the workers
    if args.only in (None, "codec"):
        codec_table(args.mb, args.block)
    if args.only in (None, "error"):
        error_table(args.block)
    if args.only in (None, "allreduce"):
        allreduce_table(args.mb, args.ranks, args.repeats)
    if args.only in (None, "netns"):
        netns_table(args.limited_mb, args.ranks, args.rate_mbit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
