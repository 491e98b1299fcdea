"""The int8 block format shared by the CPU codec (codec.py) and the CUDA one (cuda.py): block
size, scale bounds, the quantised tensor and the finiteness check (rules: codec.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from formats.wire import INT8_BLOCK, SCALE_BYTES

DEFAULT_BLOCK = INT8_BLOCK
"""Values per fp32 scale (formats.wire.INT8_BLOCK: the planner assumes the same)."""
SCALE_FLOOR = 2.0**-126
"""FLT_MIN, the smallest normal fp32: the lower bound of every scale."""
SCALE_CEIL = float(torch.tensor(0x7C010203, dtype=torch.int32).view(torch.float32))
"""Largest fp32 s with 127 * s finite (2.6793884e36, bits 0x7c010203): x' never overflows."""


class NonFiniteError(ValueError):
    """The tensor to quantise holds NaN or inf: refusing to spread it to every replica."""


@dataclass
class QuantizedTensor:
    """int8 codes and one fp32 scale per block of a flat tensor of `numel` values."""

    codes: torch.Tensor
    """(numel,) int8, on the input's device."""
    scales: torch.Tensor
    """(ceil(numel / block),) float32, on the input's device."""
    numel: int
    block: int

    def nbytes(self) -> int:
        """Bytes on the wire: codes plus scales (= formats.wire.payload_bytes, the planner's
        size: tests/test_wire_sizes.py)."""
        return self.codes.numel() + SCALE_BYTES * self.scales.numel()


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise NonFiniteError naming how many values are NaN/inf and the first index."""
    flat = x.reshape(-1)
    # CPU: cache-sized passes, no full-size bool temporary; GPU: one pass, one sync
    step = 1 << 20 if not flat.is_cuda else max(1, flat.numel())
    if all(bool(torch.isfinite(flat[lo: lo + step]).all()) for lo in range(0, flat.numel(), step)):
        return
    bad = ~torch.isfinite(flat)
    idx = int(bad.nonzero()[0, 0])
    raise NonFiniteError(f"{what}: {int(bad.sum())} NaN/inf values of {x.numel()} (first at "
                         f"index {idx}, value {float(flat[idx])}); refusing to quantise them "
                         "(a diverged replica would poison every other one)")
