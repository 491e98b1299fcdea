"""Block-wise int8 quantisation of flat fp32 tensors (the CPU path; the CUDA path in cuda.py
runs int8.cu with the same rounding rules and gives the same codes bit for bit).

Per block of `block` values: scale = absmax / 127; code = round-half-even(x * (127 / absmax)),
clamped to [-127, 127]; x' = code * scale. Error bound: |x - x'| <= scale / 2 per element,
up to fp32 rounding of the products (a few ulp of |x|). Absmax (not a +-k sigma window) was
chosen by measured error: `python benchmarks/quant_allreduce.py --only error` prints both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 256


class NonFiniteError(ValueError):
    """The tensor to quantise holds NaN or inf: refusing to spread it to every replica."""


@dataclass
class QuantizedTensor:
    """int8 codes and one fp32 scale per block of a flat tensor of `numel` values."""

    codes: torch.Tensor
    """(numel,) int8."""
    scales: torch.Tensor
    """(ceil(numel / block),) float32."""
    numel: int
    block: int

    def nbytes(self) -> int:
        """Bytes on the wire: codes plus scales."""
        return self.codes.numel() + 4 * self.scales.numel()


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise NonFiniteError naming how many values are NaN/inf and the first index."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise NonFiniteError(f"{what}: {int(bad.sum())} NaN/inf values (first at index {idx}, "
                             f"value {float(x.view(-1)[idx])}); not quantising them")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(nblocks, block) view of x padded with zeros."""
    n = x.numel()
    pad = (-n) % block
    flat = x.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def quantize_int8(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> QuantizedTensor:
    """Quantise a flat fp32 CPU tensor; NonFiniteError on NaN/inf. O(numel)."""
    assert x.dtype == torch.float32, "quantize_int8 takes fp32"
    check_finite(x)
    blocks = _blocks(x, block)  # (nblocks, block)
    absmax = blocks.abs().amax(dim=1)  # (nblocks,)
    inv = torch.where(absmax > 0, torch.tensor(127.0) / absmax, torch.zeros_like(absmax))
    codes = torch.round(blocks * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(codes.view(-1)[: x.numel()].clone(), absmax / 127.0, x.numel(), block)


def dequantize_int8(q: QuantizedTensor) -> torch.Tensor:
    """fp32 values back from codes and scales."""
    pad = (-q.numel) % q.block
    codes = q.codes if not pad else torch.cat([q.codes, q.codes.new_zeros(pad)])
    out = codes.view(-1, q.block).to(torch.float32) * q.scales[:, None]
    return out.view(-1)[: q.numel]
