"""The CUDA path: int8.cu compiled at run time by cupy.RawModule, on torch CUDA tensors without
copies (DLPack). Same codes as the CPU path bit for bit (see int8.cu for the rules).
cupy is the optional `gpu` extra; importing this module does not need it. Scalar kernel
arguments are passed as explicit numpy int64/int32 to match the kernels' long long/int."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from modules.quant.codec import DEFAULT_BLOCK, QuantizedTensor, check_finite

KERNEL_SOURCE = Path(__file__).with_name("int8.cu")
_THREADS = 256


@functools.lru_cache(maxsize=1)
def _module():  # noqa: ANN202 - a cupy.RawModule, and cupy may be absent
    import cupy

    return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++14",))


def _cp(t: torch.Tensor):  # noqa: ANN202
    import cupy

    return cupy.from_dlpack(t)


def quantize_int8_cuda(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> QuantizedTensor:
    """Quantise a flat contiguous fp32 CUDA tensor; NonFiniteError on NaN/inf."""
    assert x.is_cuda and x.dtype == torch.float32 and x.is_contiguous()
    check_finite(x)
    n = x.numel()
    nblocks = -(-n // block)
    absmax = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    scales = torch.empty_like(absmax)
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    mod = _module()
    threads = min(_THREADS, 1 << (block - 1).bit_length())
    mod.get_function("block_absmax")((nblocks,), (threads,),
                                     (_cp(x), _cp(absmax), np.int64(n), np.int32(block)),
                                     shared_mem=4 * threads)
    grid = (-(-n // _THREADS),)
    mod.get_function("quantize")(grid, (_THREADS,),
                                 (_cp(x), _cp(absmax), _cp(codes), _cp(scales), np.int64(n),
                                  np.int32(block)))
    return QuantizedTensor(codes, scales, n, block)


def dequantize_int8_cuda(q: QuantizedTensor) -> torch.Tensor:
    """fp32 CUDA tensor back from codes and scales on the GPU."""
    out = torch.empty(q.numel, dtype=torch.float32, device=q.codes.device)
    grid = (-(-q.numel // _THREADS),)
    _module().get_function("dequantize")(grid, (_THREADS,),
                                         (_cp(q.codes), _cp(q.scales), _cp(out), np.int64(q.numel),
                                          np.int32(q.block)))
    return out
