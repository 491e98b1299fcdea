"""The header of a `.safetensors` file, read and checked against the file before anything else
is: pure python, no torch, no safetensors library.

Layout: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype": D, "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the data, where each tensor's bytes lie at [begin, end) after the header. The safetensors
library refuses a bad file with a SafetensorError traceback (or, for a header that claims 2^62
bytes, tries to read them); here every such file is a UserError naming the file and what is
wrong, and a reader that passed these checks can let the library map the file: every tensor's
bytes are inside it, their sizes agree with dtype and shape, and together they cover the data
exactly (the library's own rule).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from formats.checks import shown
from formats.errors import UserError
from formats.safe_files import strict_loads
from formats.safe_open import open_regular

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own limit on the JSON header."""
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8, "C64": 8}
"""Element size of each dtype the format defines with whole bytes."""
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype, shape and byte range in the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | os.PathLike, where: str) -> dict[str, TensorEntry]:
    """{tensor name: entry} of the safetensors file `path`, checked against the file's size;
    UserError `WHERE PATH: problem` for anything that is not a sound safetensors file."""
    p = Path(path)
    label = f"{where} {p}"
    with open_regular(p, where) as f:  # a directory, FIFO or device: refused by name
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise UserError(f"{label}: {size} bytes, too short for a safetensors file (truncated "
                            "or empty?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise UserError(f"{label}: its header claims {n} bytes but the file has "
                            f"{size - 8} after the length (truncated or not safetensors)")
        raw = f.read(n)
    if len(raw) != n:
        raise UserError(f"{label}: shorter than its header says (truncated while read?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{label}: the header is not UTF-8 text (not a safetensors file?)") \
            from None
    obj = strict_loads(text, f"{label} header", max_depth=4)
    if not isinstance(obj, dict):
        raise UserError(f"{label}: the header is not a JSON object (not a safetensors file?)")
    return _entries(obj, size - 8 - n, label)


def _entries(obj: dict, data_bytes: int, label: str) -> dict[str, TensorEntry]:
    """The checked entries of a parsed header whose data part holds `data_bytes` bytes."""
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UserError(f"{label}: __metadata__ must map names to strings")
    out = {name: _entry(name, value, data_bytes, label) for name, value in obj.items()}
    at = 0
    for name, e in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != at:
            raise UserError(f"{label}: tensor {name} starts at byte {e.begin}, expected {at} "
                            "(overlapping tensors or a hole in the data)")
        at = e.end
    if at != data_bytes:
        raise UserError(f"{label}: the tensors cover {at} bytes, the file holds {data_bytes} "
                        "after the header (truncated or padded)")
    return out


def _entry(name: str, value: object, data_bytes: int, label: str) -> TensorEntry:
    """One tensor's entry, with dtype, shape and offsets in range."""
    where = f"{label}: tensor {name}"
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = (value.get(k) for k in ("dtype", "shape", "data_offsets"))
    if dtype not in DTYPE_BYTES:
        raise UserError(f"{where}: dtype {shown(dtype)} is not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise UserError(f"{where}: shape must be a list of sizes >= 0, got {shown(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(x) is int for x in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise UserError(f"{where}: data_offsets {shown(offsets)} are not [begin, end] within "
                        f"the file's {data_bytes} data bytes")
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise UserError(f"{where}: shape {shown(shape)} of {dtype} needs {need} bytes, "
                        f"data_offsets span {offsets[1] - offsets[0]}")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
