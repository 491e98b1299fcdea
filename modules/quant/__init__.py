"""Compression of data-parallel traffic: the block-wise int8 codec (CPU + CUDA) and the
arithmetic of the compressed mean all-reduce (modules.comm.compressed moves it)."""

from modules.quant.allreduce import COMPRESSIONS, reference_compressed_mean
from modules.quant.codec import (
    DEFAULT_BLOCK,
    NonFiniteError,
    QuantizedTensor,
    dequantize_int8,
    quantize_int8,
)

__all__ = ["COMPRESSIONS", "DEFAULT_BLOCK", "NonFiniteError", "QuantizedTensor",
           "dequantize_int8", "quantize_int8", "reference_compressed_mean"]
