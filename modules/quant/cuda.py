"""The CUDA path: int8.cu compiled at run time by cupy.RawModule, run on torch CUDA tensors
without copies (DLPack views, taken on that stream) on torch's current stream. Same bytes as
the CPU path (the rules are in codec.py and int8.cu). cupy is the optional `gpu` extra:
importing this module does not need it; calling it does."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from modules.quant.blocks import DEFAULT_BLOCK, QuantizedTensor, check_finite

KERNEL_SOURCE = Path(__file__).with_name("int8.cu")
KERNELS = ("quantize_blocks", "dequantize_blocks")
_THREADS = 256  # 8 warps per CUDA block, one warp per quantisation block
_MAX_GRID = 1 << 16  # grid-stride beyond this: enough warps to fill any current GPU
COMPILE_OPTIONS = ("--std=c++14",)
"""Our options to cupy.RawModule (cupy adds its own, -ftz=true among them)."""


@functools.lru_cache(maxsize=8)
def _module(device_index: int):  # noqa: ANN202 - a cupy.RawModule; cupy may be absent
    import cupy

    with cupy.cuda.Device(device_index):
        # no --use_fast_math; cupy adds -ftz=true itself, which int8.cu is written to ignore
        return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=COMPILE_OPTIONS)


def launch(name: str, device: torch.device, nblocks: int, tensors: tuple[torch.Tensor, ...],
            scalars: tuple) -> None:
    """Run kernel `name` on torch's current stream of `device`, one warp per block (nothing
    else: scripts/gpu_rows.py times this alone). The
    tensors are taken as cupy arrays inside the stream's context: `cupy.from_dlpack` outside it
    would hand torch cupy's null stream as the consumer, and torch would make its stream wait
    for all work on the device (the overlapped outer sync's included)."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    grid = (max(1, min(_MAX_GRID, -(-nblocks * 32 // _THREADS))),)
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream):
        arrays = tuple(cupy.from_dlpack(t.detach()) for t in tensors)
        _module(index).get_function(name)(grid, (_THREADS,), arrays + scalars)


def quantize_int8_cuda(x: torch.Tensor, block: int = DEFAULT_BLOCK,
                       mark_nonfinite: bool = False) -> QuantizedTensor:
    """Quantise a contiguous fp32 CUDA tensor (taken flat); NonFiniteError on NaN/inf (one
    8-byte read back). `mark_nonfinite`: NaN/inf count as 0 and their block's scale is NaN
    (the pipeline's rows, the compressed all-reduce's chunks), decided on the GPU: nothing is
    read back, no host sync."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    n = x.numel()
    nblocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n == 0:
        return QuantizedTensor(codes, scales, 0, block)
    nonfinite = torch.zeros(1, dtype=torch.int64, device=x.device)
    launch("quantize_blocks", x.device, nblocks, (x.view(-1), codes, scales, nonfinite),
            (np.int64(n), np.int32(block), np.int64(nblocks), np.int32(int(mark_nonfinite))))
    if not mark_nonfinite and int(nonfinite.item()):  # 8 bytes; find the first bad value
        check_finite(x)
    return QuantizedTensor(codes, scales, n, block)


def dequantize_int8_cuda(q: QuantizedTensor) -> torch.Tensor:
    """fp32 CUDA tensor back from codes and scales on the GPU."""
    out = torch.empty(q.numel, dtype=torch.float32, device=q.codes.device)
    nblocks = -(-q.numel // q.block)
    if q.numel:
        launch("dequantize_blocks", q.codes.device, nblocks, (q.codes, q.scales, out),
                (np.int64(q.numel), np.int32(q.block), np.int64(nblocks)))
    return out
