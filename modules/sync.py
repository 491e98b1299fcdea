"""Data-parallel averaging of a stage group, and the tied-embedding gradient sum.

`make_group_average` is the single place where the payload is chosen: fp32 gloo all-reduce for
`none`, modules.quant's fp16/int8 mean all-reduce otherwise; everything else calls the function
it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from formats.errors import UserError
from modules.dist import Comm, PeerError

GroupAverage = Callable[[torch.Tensor], int]
"""Averages a flat fp32 tensor in place over a stage group; returns the bytes it sent."""


def check_compression(compression: str, group_size: int) -> None:
    """UserError before any rendezvous when the plan asks for an unknown payload."""
    if compression not in ("none", "fp16", "int8"):
        raise UserError(f"sync.compression: {compression!r} is not one of none, fp16, int8")


def make_group_average(comm: Comm, group: dist.ProcessGroup | None, group_size: int,
                       compression: str, what: str) -> GroupAverage:
    """The averaging function of one stage group (identity for a group of one).

    Returns the bytes this rank put on the wire: for `none` what a ring all-reduce sends,
    2 (W-1)/W x 4 bytes per element; for fp16/int8 what modules.quant reports.
    """
    if group is None or group_size == 1:
        return lambda tensor: 0
    check_compression(compression, group_size)
    if compression != "none":
        return lambda tensor: _compressed_average(comm, tensor, group, compression, what)

    def average(tensor: torch.Tensor) -> int:
        before = comm.bytes_sent
        comm.all_reduce_sum(tensor, group, what)
        tensor /= group_size
        return comm.bytes_sent - before

    return average


def _compressed_average(comm: Comm, tensor: torch.Tensor, group: dist.ProcessGroup,
                        compression: str, what: str) -> int:
    """fp16/int8 mean all-reduce (modules.quant); its waits use the process group's timeout."""
    from modules.quant import compressed_all_reduce_mean

    t0 = time.perf_counter()
    try:
        sent = compressed_all_reduce_mean(tensor, group, compression)
    except RuntimeError as e:  # a gloo timeout or a closed connection
        raise PeerError(f"{what} ({compression}): no answer within {comm.timeout_s:g} s "
                        f"({str(e).strip().splitlines()[0][:300] if str(e).strip() else e})") \
            from None
    finally:
        comm.wait_s += time.perf_counter() - t0
    comm.bytes_sent += sent
    return sent


def average_grads(params: list[torch.nn.Parameter], average: GroupAverage) -> int:
    """Average the gradients of `params` with one flat all-reduce; returns bytes sent."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    sent = average(flat)
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)
    return sent


def sum_tied_grads(pair: list[torch.nn.Parameter], comm: Comm,
                   group: dist.ProcessGroup | None) -> None:
    """Give the tied embedding copies (first and last stage) the sum of their gradients."""
    if len(pair) == 2:  # both copies on this stage
        total = pair[0].grad + pair[1].grad
        pair[0].grad.copy_(total)
        pair[1].grad.copy_(total)
    elif len(pair) == 1 and group is not None:
        comm.all_reduce_sum(pair[0].grad, group, "tied-embedding gradient sum with the other "
                                                 "end of my pipeline")
