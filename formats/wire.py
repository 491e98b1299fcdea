"""Bytes on the wire, written once for the planner (scheduler/simulator/kernel.py) and the
runtime (modules/quant, modules/pipeline/wire.py): the data-parallel payload per parameter and
the pipeline message per activation. Pure arithmetic: tests/test_wire_sizes.py checks that
what the runtime's codecs actually encode has exactly these sizes.

Data-parallel payload (`sync.compression`): none = fp32 (4 bytes a value), fp16 (2), int8 =
one int8 code a value plus one fp32 scale per block of INT8_BLOCK values.
Pipeline message (`pipeline_compression`): none = the compute dtype, bf16 = 2 bytes a value
(never more than the compute dtype), int8 = one code a value plus one fp32 scale per token row.
"""

from __future__ import annotations

import math

from formats.plan import COMPRESSIONS, PIPELINE_COMPRESSIONS

INT8_BLOCK = 256
"""Values per fp32 scale of the int8 all-reduce payload (the codec's default block)."""
SCALE_BYTES = 4
"""One fp32 scale (per int8 block, per int8 pipeline row)."""
VALUE_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}
"""Bytes of one value of each encoding (none: fp32 for the payload)."""


def payload_bytes_per_param(compression: str, int8_block: int = INT8_BLOCK) -> float:
    """Bytes per parameter of the data-parallel all-reduce payload (int8: scales amortised)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}")
    extra = SCALE_BYTES / int8_block if compression == "int8" else 0.0
    return VALUE_BYTES[compression] + extra


def payload_bytes(compression: str, numel: int, int8_block: int = INT8_BLOCK) -> int:
    """Exact bytes of the payload of `numel` values (int8: a scale for every started block)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}")
    scales = math.ceil(numel / int8_block) if compression == "int8" else 0
    return VALUE_BYTES[compression] * numel + SCALE_BYTES * scales


def pipeline_value_bytes(compression: str, compute_bytes: int) -> int:
    """Bytes per activation value of a pipeline message (before int8's row scales)."""
    if compression not in PIPELINE_COMPRESSIONS:
        raise ValueError(f"unknown pipeline compression {compression!r}")
    if compression == "none":
        return compute_bytes
    return min(VALUE_BYTES[compression], compute_bytes)


def pipeline_message_bytes(compression: str, numel: int, row: int, compute_bytes: int = 4) -> int:
    """Bytes of one pipeline message of `numel` values in rows of `row` (d_model) values;
    `compute_bytes`: bytes per value of the compute dtype (what `none` sends)."""
    rows = numel // row if numel else 0
    scales = SCALE_BYTES * rows if compression == "int8" else 0
    return numel * pipeline_value_bytes(compression, compute_bytes) + scales
