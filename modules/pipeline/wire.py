"""What crosses a pipeline link: activations (forward) and activation gradients (backward), one
message per micro-batch, in the plan's `pipeline_compression` (or --pipeline-compression):

- `none`: the compute dtype (--precision: fp32 4 bytes a value, bf16/fp16 2), as before;
- `bf16`: bfloat16, 2 bytes a value whatever the precision (fp32's exponent range, so fp16's
  loss-scaled gradients do not overflow on the wire; relative error <= 2**-8);
- `int8`: one int8 code a value and one fp32 scale per token row of d_model values
  (modules.quant.rows), d_model + 4 bytes a row; error <= max|row| / 254 per value.

The receiver decodes into fp32, so every stage's residual stream and backward input stay fp32.
Bytes of one message of a (micro_batch_size, seq_len, d_model) tensor: `message_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from formats import wire
from formats.plan import PIPELINE_COMPRESSIONS
from modules.device.precision import Precision
from modules.quant.rows import decode_rows, encode_rows


def message_bytes(compression: str, shape: tuple[int, ...], compute_bytes: int = 4) -> int:
    """Bytes of one pipeline message of an activation of `shape` (last dim d_model);
    `compute_bytes`: bytes per value of the compute dtype (what `none` sends); the formula is
    formats.wire's, the planner's too."""
    return wire.pipeline_message_bytes(compression, math.prod(shape), shape[-1], compute_bytes)


@dataclass(frozen=True)
class PipelineWire:
    """Encodes what a stage sends and decodes what it receives over its pipeline links."""

    compression: str = "none"
    """none (the compute dtype), bf16 or int8 (per token row)."""
    precision: Precision | None = None
    """The compute precision (what `none` sends); None: fp32 on the CPU."""

    def __post_init__(self) -> None:
        if self.compression not in PIPELINE_COMPRESSIONS:
            raise ValueError(f"pipeline compression: {self.compression!r} is not one of "
                             f"{', '.join(PIPELINE_COMPRESSIONS)}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of a message (uint8 for int8: scales and codes as bytes)."""
        if self.compression == "int8":
            return torch.uint8
        if self.compression == "bf16":
            return torch.bfloat16
        return self.precision.wire_dtype if self.precision is not None else torch.float32

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the message of one activation of `shape`."""
        return message_bytes(self.compression, shape, torch.empty((), dtype=self.dtype)
                             .element_size())

    def buffer(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """An empty receive buffer for the message of one activation of `shape`."""
        if self.compression == "int8":
            return torch.empty(self.nbytes(shape), dtype=torch.uint8, device=device)
        return torch.empty(shape, dtype=self.dtype, device=device)

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        """The contiguous message for activation (or gradient) `t`."""
        t = t.detach()
        if self.compression == "int8":
            return encode_rows(t)
        return t.to(self.dtype).contiguous()

    def decode(self, message: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The fp32 tensor of `shape` a received message stands for."""
        if self.compression == "int8":
            return decode_rows(message, shape)
        return message.float().view(shape)
