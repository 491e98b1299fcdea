"""GB/s of the int8 codec's CUDA kernels against the GPU's memory bandwidth (target >= 70%).

    python benchmarks/kernel_bandwidth.py [--mb 256] [--block 256] [--device 0]
        [--peak-gbps X] [--min-percent 70] [--json OUT]

DRAM traffic counted per kernel: quantise reads 4 B and writes 1 B per value, plus one 4 B scale
per block; dequantise the reverse. The peak is 2 x memory clock x bus width from the device's
properties (or --peak-gbps); a device-to-device copy (read + write) is timed beside the kernels
as what the memory reaches in practice. Each kernel: one warm-up, then the mean of 20 launches
between CUDA events. The input (256 MB by default) is several times any current L2 cache.
Exit status 1 when a kernel is below --min-percent of the peak or the peak is unknown; without
a CUDA device or cupy it says so and exits 0 (nothing to time).
(benchmarks/quant_allreduce.py prints the same kernels' GB/s in its codec section.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda  # noqa: E402

CUDA_ATTR_MEMORY_CLOCK_KHZ, CUDA_ATTR_BUS_WIDTH_BITS = 36, 37  # cudaDeviceAttr values


def memory_peak_gbps(index: int) -> float | None:
    """Theoretical DRAM bandwidth (GB/s) of CUDA device `index`, None if the driver hides it."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    if not (clock_khz and bus_bits):  # CUDA 13 dropped these fields from the properties
        get = cupy.cuda.runtime.deviceGetAttribute
        clock_khz = get(CUDA_ATTR_MEMORY_CLOCK_KHZ, index)
        bus_bits = get(CUDA_ATTR_BUS_WIDTH_BITS, index)
    if not (clock_khz and bus_bits):
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def mean_seconds(fn: Callable[[], object], repeats: int = 20) -> float:
    """Mean seconds of one `fn()` on the GPU (after one warm-up), timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure(mb: float, block: int, index: int) -> list[dict]:
    """Rows {kernel, ms, bytes, gbps} for quantise, dequantise and a device copy."""
    x = torch.randn(int(mb * 2**20 / 4), device=torch.device("cuda", index))
    n = x.numel()
    q = quantize_int8_cuda(x, block)
    codec_bytes = 5 * n + 4 * (-(-n // block))
    rows = [("quantise (int8.cu)", lambda: quantize_int8_cuda(x, block), codec_bytes),
            ("dequantise (int8.cu)", lambda: dequantize_int8_cuda(q), codec_bytes),
            ("device copy (torch clone)", lambda: x.clone(), 8 * n)]
    out = []
    for name, fn, nbytes in rows:
        secs = mean_seconds(fn)
        out.append({"kernel": name, "ms": secs * 1e3, "bytes": nbytes,
                    "gbps": nbytes / secs / 1e9})
    return out


def report(rows: list[dict], peak: float | None, min_percent: float) -> bool:
    """Print the table; True when both codec kernels reach min_percent of the peak."""
    print("| kernel | ms | GB/s | % of peak | % of copy |\n|---|---|---|---|---|")
    copy = rows[-1]["gbps"]
    for r in rows:
        r["percent_of_peak"] = 100 * r["gbps"] / peak if peak else None
        pct = f"{r['percent_of_peak']:.0f}" if peak else "-"
        print(f"| {r['kernel']} | {r['ms']:.3f} | {r['gbps']:.0f} | {pct} | "
              f"{100 * r['gbps'] / copy:.0f} |")
    codec = [r["percent_of_peak"] for r in rows[:2]]
    if peak is None:
        print("memory peak unknown (pass --peak-gbps): no verdict")
        return False
    ok = all(p >= min_percent for p in codec)
    print(f"target: both kernels >= {min_percent:g}% of the {peak:.0f} GB/s peak: "
          f"{'met' if ok else 'NOT met'} (quantise {codec[0]:.0f}%, dequantise {codec[1]:.0f}%)")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Time the kernels; exit 1 below the target, 0 otherwise or without a GPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256.0, help="fp32 input size in MB")
    p.add_argument("--block", type=int, default=256, help="values per quantisation block")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--peak-gbps", type=float, help="memory bandwidth to compare against")
    p.add_argument("--min-percent", type=float, default=70.0, help="target, %% of the peak")
    p.add_argument("--json", help="also write the rows, peak and verdict to this file")
    args = p.parse_args(argv)
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("no cupy (install the gpu extra): the CUDA kernels are not timed")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: the CUDA kernels are not timed")
        return 0
    peak = args.peak_gbps or memory_peak_gbps(args.device)
    name = torch.cuda.get_device_name(args.device)
    print(f"int8 codec kernels on {name}, {args.mb:g} MB fp32, block {args.block}, memory peak "
          f"{f'{peak:.0f} GB/s' if peak else 'unknown'}\n")
    rows = measure(args.mb, args.block, args.device)
    ok = report(rows, peak, args.min_percent)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_gbps": peak, "rows": rows,
                                               "min_percent": args.min_percent, "met": ok},
                                              indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
