"""Compression of data-parallel traffic: block-wise int8 codec (CPU + CUDA) and all-reduce."""

from modules.quant.allreduce import COMPRESSIONS, compressed_all_reduce_mean
from modules.quant.codec import (
    DEFAULT_BLOCK,
    NonFiniteError,
    QuantizedTensor,
    dequantize_int8,
    quantize_int8,
)

__all__ = ["COMPRESSIONS", "DEFAULT_BLOCK", "NonFiniteError", "QuantizedTensor",
           "compressed_all_reduce_mean", "dequantize_int8", "quantize_int8"]
