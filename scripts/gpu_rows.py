"""The in-process GPU rows of scripts/gpu_check.py: the int8 kernel's bytes against the CPU
codec (compiled through cupy itself, denormals included), its bandwidth against the device's
measured copy bandwidth, and the NCCL communicator's stream ordering on one GPU. Each returns
(status, detail); torch and cupy are imported only when a row runs."""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np

BANDWIDTH_WARN = 0.7
"""Below this fraction of the measured copy bandwidth a kernel's row is a WARN (never FAIL)."""


def _same(want, got) -> bool:  # noqa: ANN001 - torch tensors
    return want.cpu().numpy().tobytes() == got.cpu().numpy().tobytes()


def _cases():  # noqa: ANN202
    """(name, fp32 CPU tensor, block): random magnitudes over 1e-40..1e24, and denormals."""
    import torch

    from modules.quant.kernel_model import DENORMAL_CASE

    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(1 << 16) * np.repeat(10.0 ** np.arange(-40, 24, 4), 4096))
    return [("random, magnitudes 1e-40..1e24", torch.from_numpy(wide.astype(np.float32)), 256),
            ("denormal blocks", torch.from_numpy(DENORMAL_CASE.copy()), 8),
            ("one partial block", torch.randn(1000, generator=torch.Generator().manual_seed(1)),
             256)]


def kernel_identity() -> tuple[str, str]:
    """int8.cu through cupy.RawModule (cupy's own flags, -ftz=true included) against the CPU
    codec: codes, scales and decoded values byte for byte, and the pipeline's per-row
    messages (NaN/inf rows marked on the GPU)."""
    import cupy

    from modules.quant.codec import dequantize_int8, quantize_int8_torch
    from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda

    bad = []
    for name, x, block in _cases():
        want = quantize_int8_torch(x, block)
        got = quantize_int8_cuda(x.cuda(), block)
        if not (_same(want.codes, got.codes) and _same(want.scales, got.scales)):
            diff = int((want.codes != got.codes.cpu()).sum())
            bad.append(f"{name}: {diff} codes differ")
        elif not _same(dequantize_int8(want), dequantize_int8_cuda(got)):
            bad.append(f"{name}: decoded values differ")
    why = row_codec_mismatch("cuda")
    if why:
        bad.append(f"pipeline rows: {why}")
    if bad:
        return "FAIL", "; ".join(bad)
    return "PASS", (f"codes, scales and decoded values byte-identical to the CPU codec "
                    f"({len(_cases())} cases, denormals included; pipeline rows too), "
                    f"compiled by cupy {cupy.__version__}")


def row_codec_mismatch(device: str, shape: tuple[int, ...] = (2, 1024, 2048)) -> str:
    """Empty when the pipeline's per-row int8 (modules.quant.rows) on `device` writes the same
    message as on the CPU and decodes it to the same values, non-finite rows (-> NaN) included;
    else what differs."""
    import torch

    from modules.quant.rows import decode_rows, encode_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 10
    x[0, shape[1] // 2, 3 % shape[-1]], x[-1, -1, 0] = float("inf"), float("nan")
    want, got = encode_rows(x), encode_rows(x.to(device))
    if got.device.type != torch.device(device).type:
        return f"the message was made on {got.device}, not {device}"
    if not torch.equal(want, got.cpu()):
        diff = int((want != got.cpu()).sum())
        return f"{diff} of {want.numel()} message bytes differ from the CPU path"
    a, b = decode_rows(want, shape), decode_rows(got, shape).cpu()
    if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())):
        return "decoded values differ from the CPU path"
    bad = ~torch.isfinite(x).all(-1)
    if not (a[bad].isnan().all() and a[~bad].isfinite().all()):
        return "the rows holding inf/NaN did not (only) decode to NaN"
    return ""


def _elapsed_ms(fn, reps: int) -> float:  # noqa: ANN001
    """Mean ms of `fn()` between CUDA events on the current stream (one warm-up first)."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def kernel_bandwidth(n: int = 1 << 26, block: int = 256) -> tuple[str, str]:
    """GB/s of both kernels (CUDA events around the launches alone: buffers made before, no
    read-back) as a share of a device-to-device copy's GB/s, measured here the same way."""
    import torch

    from modules.quant.cuda import launch

    x = torch.randn(n, device="cuda")
    nblocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.int8, device="cuda")
    scales = torch.empty(nblocks, device="cuda")
    flag, out, dst = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.empty_like(x), \
        torch.empty_like(x)
    scalars = (np.int64(n), np.int32(block), np.int64(nblocks))
    copy_gbs = 2 * 4 * n / _elapsed_ms(lambda: dst.copy_(x), 10) / 1e6
    q_ms = _elapsed_ms(lambda: launch("quantize_blocks", x.device, nblocks,
                                      (x, codes, scales, flag), scalars + (np.int32(0),)), 10)
    d_ms = _elapsed_ms(lambda: launch("dequantize_blocks", x.device, nblocks,
                                      (codes, scales, out), scalars), 10)
    rates = {"quantize": (5 * n + 4 * nblocks) / q_ms / 1e6,
             "dequantize": (5 * n + 4 * nblocks) / d_ms / 1e6}
    share = {k: v / copy_gbs for k, v in rates.items()}
    detail = ", ".join(f"{k} {v:.0f} GB/s ({100 * share[k]:.0f}%)" for k, v in rates.items())
    ok = min(share.values()) >= BANDWIDTH_WARN
    return ("PASS" if ok else "WARN"), (f"{detail} of a device copy's {copy_gbs:.0f} GB/s "
                                        f"(bar {100 * BANDWIDTH_WARN:.0f}%, WARN below; "
                                        f"{n >> 20} Mi values, block {block})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_ordering(sleep_cycles: int = 200_000_000) -> tuple[str, str]:
    """One-rank NCCL communicator: hold the current stream with torch.cuda._sleep, write the
    input behind it and all-gather. The gathered copies must see the written values, and the
    watchdog must see the operation in flight while the stream is held (an event recorded on
    another stream would be done at once)."""
    import torch
    import torch.distributed as dist

    from modules.comm.nccl import CupyNcclCommunicator

    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    comm = CupyNcclCommunicator([0], 0, store, "order", "cuda:0", timeout_s=60)
    problems = []
    try:
        t = torch.zeros(1 << 22, device="cuda:0")
        for value in (3.0, 5.0):
            outs = [torch.full_like(t, -1.0)]
            torch.cuda._sleep(sleep_cycles)
            t.fill_(value)
            comm.all_gather(outs, t)
            if comm.watchdog.in_flight() == 0:
                problems.append("the watchdog saw the all-gather done while the stream was held")
            comm.synchronize("stream-ordering check")
            if not bool(outs[0].eq(value).all()):
                problems.append(f"the gathered copy does not hold {value} (read before NCCL "
                                "wrote it)")
    finally:
        comm.close()
    if problems:
        return "FAIL", "; ".join(problems)
    return "PASS", ("all-gather behind a held stream: copies ordered after NCCL, the op seen in "
                    "flight by the watchdog (2 rounds)")
