"""Model FLOPs utilisation: the model's training FLOPs per token x tokens/s / the device's peak.

FLOPs per token come from `formats.models.ModelSpec`, the same counts the planner's simulator
uses: forward = 2 x (matmul parameters) + 4 x seq_len x d_model of attention per layer, plus
2 x vocab x d_model for the LM head; training = 3 x forward (backward = 2 x forward). For the
whole model that is 6 N + 12 L T d (N = matmul parameters of the blocks and the head, L layers,
T sequence length, d model width), the usual model-FLOPs convention: embedding look-ups,
norms, biases and softmax are not counted, and neither is recomputation. The
simulator's compute time is `stage_flops_per_token x tokens x (3, or 4 with --recompute on) /
(tflops x --mfu)`, so an MFU measured here is what to pass as the planner's `--mfu` with
`--recompute off` (the runtime does not recompute).

The peak is the device's TFLOP/s from --peak-tflops, else its cluster entry's `tflops`; with
neither (e.g. a CPU rank with no cluster file) there is no peak to divide by and MFU is None:
a CPU's peak depends on its vector units and clocks and is not guessed here.
"""

from __future__ import annotations

import math

from formats.errors import UserError
from formats.models import ModelSpec

TRAIN_FLOPS_PER_FORWARD = 3.0
"""Training FLOPs / forward FLOPs: forward once, backward twice (input and weight gradients)."""


def flops_per_token(spec: ModelSpec, start: int = 0, end: int | None = None) -> float:
    """Training FLOPs per token of layers [start, end) (default: the whole model), the LM head
    included when `end` is the last layer: what one token costs the stage holding them."""
    end = spec.num_layers if end is None else end
    return TRAIN_FLOPS_PER_FORWARD * spec.stage_flops_per_token(start, end)


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Fraction of `peak_tflops` the training reaches (None without a peak).

    Per rank: the tokens/s through its stage (tokens per step of its replica / step seconds)
    with `flops_per_token(spec, start, end)` of its stage; for a whole run: all replicas'
    tokens/s with `flops_per_token(spec)` and the sum of the devices' peaks.
    """
    if peak_tflops is None:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def check_peak_tflops(value: float | None) -> None:
    """UserError naming --peak-tflops unless it is None or a positive finite number."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UserError(f"--peak-tflops: must be a positive number of TFLOP/s, got {value}")


def resolve_peak_tflops(flag: float | None, cluster_tflops: float | None) -> float | None:
    """--peak-tflops, else the rank's cluster entry `tflops`, else None (MFU left out)."""
    check_peak_tflops(flag)
    return flag if flag is not None else cluster_tflops
