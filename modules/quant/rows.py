"""Per-row int8 for pipeline messages: one fp32 scale per row of the last dimension (a token's
d_model values of an activation or activation gradient).

It is the block codec of codec.py with block = the row length, so the rounding rules, the error
bound (|x - x'| <= scale/2 + 2**-23 |x|, scale = max|row|/127) and the CPU/CUDA split are the
same: CPU tensors go to the torch path, CUDA tensors to int8.cu (one warp per row), and both give
the same bytes.

Message of R rows of `row` values (uint8): the R scales' bytes first (fp32, so their view stays
4-byte aligned), then the R x row codes: R (row + 4) bytes, (row + 4) / (4 row) of fp32
(d_model 128: 0.258; 768: 0.251).

Non-finite values: the data-parallel codec refuses them (a diverged replica must not poison the
others), but in a pipeline an inf activation gradient is an ordinary fp16 overflow that the step
has to see to be skipped. So a row holding NaN/inf is sent with scale NaN and decodes to a row of
NaN: never finite garbage. The receiving stage's gradients then hold NaN, which fp16's overflow
check skips and the trainer's non-finite check stops on (other precisions).

Quality: at equal tokens int8 (and bf16) end within noise of `none` (gpt-tiny, 2 stages, real
text: benchmarks/pipeline_compression.py), so no error feedback or stochastic rounding is used.
"""

from __future__ import annotations

import math

import torch

from formats import wire
from formats.wire import SCALE_BYTES
from modules.quant.blocks import NonFiniteError, QuantizedTensor
from modules.quant.codec import cupy_available, dequantize_int8, quantize_int8
from modules.quant.cuda import quantize_int8_cuda


def row_message_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the int8 message of a tensor of `shape` (rows = the last dimension)."""
    return wire.pipeline_message_bytes("int8", math.prod(shape), shape[-1])


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """The uint8 message of `x` (any float dtype, quantised per row of its last dimension)."""
    row = x.shape[-1]
    flat = x.detach().to(torch.float32).contiguous().reshape(-1)
    if _on_gpu(flat):  # the kernel marks NaN/inf rows itself: no host sync per message
        q = quantize_int8_cuda(flat, row, mark_nonfinite=True)
        return torch.cat([q.scales.view(torch.uint8), q.codes.view(torch.uint8)])
    try:
        q = quantize_int8(flat, row)
    except NonFiniteError:  # rare (fp16 overflow, divergence): find the rows, then mark them
        q = _quantize_marking_non_finite(flat, row)
    return torch.cat([q.scales.view(torch.uint8), q.codes.view(torch.uint8)])


def decode_rows(message: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 tensor of `shape` back from `encode_rows`'s message (on the message's device)."""
    numel = math.prod(shape)
    nrows = numel // shape[-1] if numel else 0
    if message.numel() != row_message_bytes(shape):
        raise ValueError(f"int8 row message: {message.numel()} bytes, a {tuple(shape)} tensor "
                         f"needs {row_message_bytes(shape)}")
    scales = message[: SCALE_BYTES * nrows].view(torch.float32)
    codes = message[SCALE_BYTES * nrows:].view(torch.int8)
    return dequantize_int8(QuantizedTensor(codes, scales, numel, shape[-1])).view(shape)


def _on_gpu(flat: torch.Tensor) -> bool:
    """Whether `flat` goes to the CUDA kernel (a CUDA tensor and cupy importable)."""
    return flat.is_cuda and cupy_available()


def _quantize_marking_non_finite(flat: torch.Tensor, row: int) -> QuantizedTensor:
    """Quantise with NaN/inf taken as 0, then give every row that held one the scale NaN."""
    finite = torch.isfinite(flat)
    bad_rows = ~finite.view(-1, row).all(dim=1)
    q = quantize_int8(torch.where(finite, flat, torch.zeros_like(flat)), row)
    q.scales[bad_rows] = float("nan")
    return q
