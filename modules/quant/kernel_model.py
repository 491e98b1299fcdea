"""A numpy model of int8.cu's quantisation arithmetic, beside the CPU codec (codec.py): each
float operation of the kernel either keeps denormals (IEEE) or flushes them to zero, as the
`.ftz` form of its PTX instruction does (denormal inputs and results become a zero of the same
sign). Which operations flush is read off the kernel's PTX (`ftz_ops`), so a test can say what
the kernel as compiled by cupy (which always passes -ftz=true) computes, without a GPU.

The operations, in the order the kernel applies them per block (rules: codec.py):
    abs   |x|                     max   the block's absmax, and the scale's floor
    div   absmax / 127, x / scale min   the scale's ceiling
    rint  round half to even      mul   code * scale (dequantise)
"""

from __future__ import annotations

import re

import numpy as np

OPS = ("abs", "max", "min", "div", "rint", "mul")
SCALE_FLOOR = np.float32(2.0**-126)
SCALE_CEIL = np.array([0x7C010203], dtype=np.uint32).view(np.float32)[0]
DENORMAL_CASE = np.array([1e-37, 1e-38, -9e-39, 1.5 * 2.0**-127, 3e-39, 0, 0, 0,
                          2.0**-149, -2.0**-140, 2.0**-130, 0, 0, 0, 0, 0], dtype=np.float32)
"""Two blocks of 8 with denormals: the CPU codes are 9, 1, -1, 1, 0... in the first; a kernel
that flushes denormals gives 9, 0, 0, 0, 0... (the second block is denormal only)."""
_PTX_OPS = {"abs": "abs", "max": "max", "min": "min", "div": "div", "mul": "mul", "cvt": "rint"}


def ftz_ops(ptx: str) -> frozenset[str]:
    """The model's operations whose PTX instructions carry `.ftz` in `ptx` (fp32 only)."""
    found = set()
    for m in re.finditer(r"^\s*(\w+)((?:\.\w+)*)", ptx, re.MULTILINE):
        op, mods = m.group(1), m.group(2).split(".")
        if "ftz" in mods and "f32" in mods and op in _PTX_OPS:
            found.add(_PTX_OPS[op])
    return frozenset(found)


def _flush(a: np.ndarray, on: bool) -> np.ndarray:
    """Denormals -> zero of the same sign (when `on`)."""
    a = np.asarray(a, dtype=np.float32)
    if not on:
        return a
    tiny = (a != 0) & (np.abs(a) < np.float32(2.0**-126))
    return np.where(tiny, np.copysign(np.float32(0), a), a).astype(np.float32)


def _op(fn, ftz: bool, *args: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """One fp32 operation: flushed inputs and result when `ftz`."""
    with np.errstate(all="ignore"):
        return _flush(fn(*(_flush(a, ftz) for a in args)), ftz)


def quantize_model(x: np.ndarray, block: int,
                   ftz: frozenset[str] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, fp32 scales) of flat finite fp32 `x` as the kernel computes them when the
    operations in `ftz` flush denormals (empty: IEEE, the CPU codec's rules)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    nblocks = -(-x.size // block)
    pad = np.zeros(nblocks * block, dtype=np.float32)
    pad[: x.size] = x
    blocks = pad.reshape(nblocks, block)
    a = _op(np.abs, "abs" in ftz, blocks)
    m = _op(lambda v: v.max(axis=1), "max" in ftz, a)
    scale = _op(np.divide, "div" in ftz, m, np.float32(127))
    scale = _op(np.maximum, "max" in ftz, scale, SCALE_FLOOR)
    scale = _op(np.minimum, "min" in ftz, scale, SCALE_CEIL)
    q = _op(np.divide, "div" in ftz, blocks, scale[:, None])
    q = _op(np.rint, "rint" in ftz, q)  # numpy's rint: half to even
    codes = np.clip(q, -127, 127).astype(np.int8).reshape(-1)[: x.size]
    return codes, scale.astype(np.float32)


def dequantize_model(codes: np.ndarray, scales: np.ndarray, block: int,
                     ftz: frozenset[str] = frozenset()) -> np.ndarray:
    """fp32 values back from codes and scales: code * scale, flushed when "mul" is in `ftz`."""
    c = np.asarray(codes, dtype=np.float32)
    s = np.repeat(np.asarray(scales, dtype=np.float32), block)[: c.size]
    return _op(np.multiply, "mul" in ftz, c, s)
