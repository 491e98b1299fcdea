#!/usr/bin/env python3
"""Stand-alone host probe (stdlib + torch; copied to each host by scripts/measure.py).

    python3 host_agent.py --d-model D --d-ff F --ffn-mats 2|3 --seq-len S --tokens T
        [--seconds 1.0]

Prints one JSON line: the host name, the device (every CUDA GPU's name and memory, else the
CPU model and RAM) and the FLOP/s of one transformer layer's forward matmuls at the model's
shapes (QKV, attention scores and weighted sum, output projection, MLP), timed on GPU 0 in
bf16 or on the CPU in fp32 (throughput over --seconds after two warm-ups, from --start-at).
Without torch it prints `{"error": "no torch", ...}` and exits 3, so the caller can name the
host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


MAX_START_WAIT_S = 60.0
"""Longest wait for --start-at (the caller starts it about 20 s ahead)."""


def layer_flops(d: int, f: int, ffn_mats: int, seq: int, tokens: int) -> float:
    """Forward FLOPs of one layer for `tokens` tokens (formats/models.py's count)."""
    return tokens * (2.0 * (4 * d * d + ffn_mats * d * f) + 4.0 * seq * d)


def bench(torch, a: argparse.Namespace) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """(FLOP/s, what ran) of one layer's forward matmuls at the given shapes."""
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator(device=dev).manual_seed(0)
    d, f, seq = a.d_model, a.d_ff, a.seq_len
    batch = max(1, a.tokens // seq)

    def rand(*shape: int):  # type: ignore[no-untyped-def]
        return torch.randn(*shape, generator=gen, device=dev, dtype=dtype) * 0.02
    x = rand(batch * seq, d)
    w_qkv, w_o = rand(d, 3 * d), rand(d, d)
    w_in, w_out = rand(d, (a.ffn_mats - 1) * f), rand(f, d)

    def layer() -> None:
        q, k, v = (x @ w_qkv).split(d, dim=1)
        heads = max(1, d // 64)
        shape = (batch * heads, seq, d // heads)
        s = q.reshape(shape) @ k.reshape(shape).transpose(1, 2)
        o = (s @ v.reshape(shape)).reshape(batch * seq, d) @ w_o
        h = o @ w_in
        (h[:, :f] @ w_out).sum()

    for _ in range(2):  # warm-ups (allocator, kernels)
        layer()
    if a.start_at:  # every host of a measurement starts timing together (shared cores, if any)
        # capped: a host whose clock runs behind must not sleep past the caller's timeout
        time.sleep(min(max(0.0, a.start_at - time.time()), MAX_START_WAIT_S))
    # Throughput over the whole window, not the median repeat, and for the whole window, not
    # a number of repeats: on cores shared with other hosts (namespaces, containers) a repeat
    # that ran inside one scheduler slice is as fast as an idle machine, and a host that
    # stopped early would hand its cores to the others.
    if cuda:
        torch.cuda.synchronize()
    done = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        while done < 5 or time.perf_counter() - t0 < a.seconds:
            layer()
            if cuda:
                torch.cuda.synchronize()
            done += 1
    elapsed = time.perf_counter() - t0
    flops = layer_flops(d, f, a.ffn_mats, seq, batch * seq) * done
    return flops / elapsed, f"{dev} {str(dtype).split('.')[-1]}"


def describe(torch) -> dict:  # type: ignore[no-untyped-def]
    """GPUs (name, memory) or the CPU (model, RAM) of this host."""
    if torch.cuda.is_available():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return {"kind": "gpu", "devices": [{"name": p.name, "memory_bytes": p.total_memory}
                                           for p in props]}
    return {"kind": "cpu", "devices": [{"name": _cpu_model(), "memory_bytes": _ram_bytes(),
                                        "threads": torch.get_num_threads()}]}


def main() -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description="host probe: device and layer FLOP/s")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--d-ff", type=int, required=True)
    p.add_argument("--ffn-mats", type=int, choices=(2, 3), default=2)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--start-at", type=float, default=0.0,
                   help="wall-clock time (epoch s) to start timing at, after torch is loaded")
    a = p.parse_args()
    info = {"hostname": socket.gethostname(), "python": sys.version.split()[0]}
    try:
        import torch
    except ImportError as e:
        print(json.dumps({**info, "error": "no torch", "detail": str(e)}))
        return 3
    flops, ran = bench(torch, a)
    print(json.dumps({**info, "torch": torch.__version__, **describe(torch),
                      "flop_per_s": flops, "bench": ran}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
