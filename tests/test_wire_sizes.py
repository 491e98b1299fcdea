"""formats.wire's sizes are what the runtime's codecs actually encode, and what the planner's
kernel charges: one definition on both sides of the planner/runtime line."""

from __future__ import annotations

import pytest
import torch

from formats import wire
from formats.models import get_model
from modules.device.precision import make_precision
from modules.pipeline.wire import PipelineWire
from modules.quant.allreduce import encode_chunk
from modules.quant.codec import quantize_int8
from scheduler.simulator.kernel import payload_bytes_per_param, pipeline_message_bytes

CPU = torch.device("cpu")


def _bytes(parts: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096])
@pytest.mark.parametrize("block", [64, 256])
def test_payload_encodings_have_the_formulas_size(numel: int, block: int) -> None:
    x = torch.randn(numel)
    assert _bytes([x]) == wire.payload_bytes("none", numel, block)
    assert _bytes(encode_chunk(x, "fp16", block)) == wire.payload_bytes("fp16", numel, block)
    assert _bytes(encode_chunk(x, "int8", block)) == wire.payload_bytes("int8", numel, block)
    assert quantize_int8(x, block).nbytes() == wire.payload_bytes("int8", numel, block)


def test_payload_per_param_is_the_limit_of_the_exact_size() -> None:
    n = 256 * 1000
    for c in ("none", "fp16", "int8"):
        assert wire.payload_bytes(c, n) == n * wire.payload_bytes_per_param(c)
        assert payload_bytes_per_param(c) == wire.payload_bytes_per_param(c)  # the planner's


@pytest.mark.parametrize("compression", ["none", "bf16", "int8"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pipeline_messages_have_the_formulas_size(compression: str, precision: str) -> None:
    model = get_model("gpt-tiny")
    shape = (3, model.seq_len, model.d_model)
    prec = make_precision(precision, CPU)
    pw = PipelineWire(compression, prec)
    msg = pw.encode(torch.randn(shape))
    sent = msg.numel() * msg.element_size()
    compute_bytes = prec.wire_dtype.itemsize
    numel = shape[0] * shape[1] * shape[2]
    assert sent == pw.nbytes(shape) == wire.pipeline_message_bytes(compression, numel,
                                                                   shape[-1], compute_bytes)
    # the planner charges the same bytes for a micro-batch of 3 sequences
    assert pipeline_message_bytes(model, 3, compression, compute_bytes) == sent
