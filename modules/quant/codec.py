"""Block-wise int8 quantisation of flat fp32 tensors: the CPU path (torch, vectorised).

The CUDA path (cuda.py running int8.cu) follows the same rules and gives the same bytes.

Rounding rules, every operation an IEEE-754 fp32 operation rounded to nearest even (no fused
multiply-add, no reciprocal approximation, denormals kept):

    absmax = max |x| over the block                        (exact: no rounding)
    scale  = min(max(absmax / 127, 2**-126), SCALE_CEIL)   (fp32 division; floor = FLT_MIN,
                                                            so scale is never 0 or denormal;
                                                            ceiling so 127 * scale <= FLT_MAX)
    code   = clamp(round_half_even(x / scale), -127, 127)  (fp32 division)
    x'     = float(code) * scale                           (fp32 multiply)

Division rather than multiplying by 127/absmax: that reciprocal overflows to inf for blocks with
absmax < 127/FLT_MAX (~3.7e-37) and turned every code into +-127 (or NaN for zeros).
Error bound per element: |x - x'| <= scale/2 + 2**-23 |x| (half a step plus the two fp32
roundings). The floor matters only for blocks with absmax < 127 * 2**-126 (~1.5e-36): their
step is 2**-126 instead of absmax/127 (a denormal scale would lose precision and break the
bound); the ceiling only for absmax within 2 ulp of FLT_MAX. Tested in
tests/test_quant_codec.py, also against a numpy float32 reference of the rules above.
Absmax (not a +-k sigma clipping window) was chosen by measured error:
`python benchmarks/quant_allreduce.py --only error` prints both.
"""

from __future__ import annotations

import torch

from modules.quant.blocks import (
    DEFAULT_BLOCK,
    SCALE_CEIL,
    SCALE_FLOOR,
    NonFiniteError,
    QuantizedTensor,
    check_finite,
)
from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda

__all__ = ["DEFAULT_BLOCK", "SCALE_CEIL", "SCALE_FLOOR", "NonFiniteError", "QuantizedTensor",
           "check_finite", "dequantize_int8", "quantize_int8"]


_CHUNK = 1 << 16
"""Values per step of the CPU loops: the fp32 scratch (256 KiB) stays in cache, and no
full-size temporaries are allocated (their page faults cost more than the arithmetic)."""


def _split(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole blocks as (nfull, block), zero-padded last partial block as (0 or 1, block))."""
    flat = x.reshape(-1)
    nfull = flat.numel() // block
    tail = flat[nfull * block:]
    padded = torch.zeros(1 if tail.numel() else 0, block, dtype=flat.dtype, device=flat.device)
    if tail.numel():
        padded[0, : tail.numel()] = tail
    return flat[: nfull * block].view(nfull, block), padded


def _check_args(x: torch.Tensor, block: int) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"quantize_int8 takes float32, got {x.dtype}")
    if not 1 <= block <= 1 << 20:
        raise ValueError(f"block: {block} is not in 1..{1 << 20}")


def _on_gpu(x: torch.Tensor) -> bool:
    """Whether `x` goes to the int8.cu kernel (a CUDA tensor, cupy importable)."""
    return x.is_cuda and cupy_available()


def quantize_int8(x: torch.Tensor, block: int = DEFAULT_BLOCK,
                  read_back: bool = True) -> QuantizedTensor:
    """Quantise fp32 `x` (any shape, taken flat) per block; NonFiniteError on NaN/inf.

    CUDA tensors go to the int8.cu kernel when cupy is importable, CPU tensors to torch.
    `read_back=False` (the compressed all-reduce, whose input was checked as a whole): on CUDA
    nothing is read back, no host sync per chunk; a NaN/inf (a mean that overflowed fp32)
    gives its block the scale NaN, so every rank decodes NaN there, never finite garbage. On
    CPU it changes nothing (a check there costs no sync).
    """
    _check_args(x, block)
    if _on_gpu(x):
        return quantize_int8_cuda(x.contiguous(), block, mark_nonfinite=not read_back)
    return quantize_int8_torch(x, block)


def quantize_int8_torch(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> QuantizedTensor:
    """The torch implementation of the rules (any device); NonFiniteError on NaN/inf."""
    _check_args(x, block)
    n = x.numel()
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    full, tail = _split(x, block)
    step = max(1, _CHUNK // block)
    scratch = torch.empty(step * block, dtype=torch.float32, device=x.device)
    parts = [(full, codes[: full.numel()].view(-1, block))]
    if tail.numel():
        parts.append((tail, None))
    b0 = 0
    for blocks, out in parts:
        for lo in range(0, blocks.shape[0], step):
            bv = blocks[lo: lo + step]
            mn, mx = torch.aminmax(bv, dim=1)
            sv = scales[b0 + lo: b0 + lo + bv.shape[0]]
            torch.maximum(mn.neg_(), mx, out=sv)  # absmax; NaN propagates into it
            if not bool(torch.isfinite(sv).all()):
                check_finite(x)  # raises, naming the count and the first index
            sv.div_(127.0).clamp_(SCALE_FLOOR, SCALE_CEIL)
            q = torch.div(bv, sv[:, None], out=scratch[: bv.numel()].view_as(bv))
            q.round_().clamp_(-127, 127)
            if out is not None:
                out[lo: lo + bv.shape[0]].copy_(q)
            else:  # the partial last block
                codes[full.numel():] = q.view(-1)[: n - full.numel()].to(torch.int8)
        b0 += blocks.shape[0]
    return QuantizedTensor(codes, scales, n, block)


def dequantize_int8(q: QuantizedTensor) -> torch.Tensor:
    """fp32 flat tensor back from codes and scales (on their device): code * scale."""
    if _on_gpu(q.codes):
        return dequantize_int8_cuda(q)
    out = torch.empty(q.numel, dtype=torch.float32, device=q.codes.device)
    nfull = q.numel // q.block
    full = nfull * q.block
    # int8 * fp32 promotes the code to fp32 exactly, then one fp32 multiply: code * scale
    torch.mul(q.codes[:full].view(nfull, q.block), q.scales[:nfull, None],
              out=out[:full].view(nfull, q.block))
    if full < q.numel:
        torch.mul(q.codes[full:], q.scales[nfull], out=out[full:])
    return out


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True
