"""Data-parallel averaging of a stage group, and the tied-embedding gradient sum.

`make_group_average` is the single place where a compressed all-reduce (fp16/int8, see
modules.quant / modules.comm) plugs in; everything else calls the function it returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from modules.dist import Comm
from scheduler.errors import UserError

GroupAverage = Callable[[torch.Tensor], int]
"""Averages a flat fp32 tensor in place over a stage group; returns the bytes it sent."""


def check_compression(compression: str, group_size: int) -> None:
    """UserError before any rendezvous when the plan asks for a payload this runtime lacks."""
    if compression != "none" and group_size > 1:
        # COMPRESSED ALL-REDUCE CALL SITE (1/2): lift this check when modules.quant is wired in
        raise UserError(f"sync.compression: {compression!r} is not available in this runtime "
                        "yet; set it to 'none' in the plan")


def make_group_average(comm: Comm, group: dist.ProcessGroup | None, group_size: int,
                       compression: str, what: str) -> GroupAverage:
    """The averaging function of one stage group (identity for a group of one)."""
    if group is None or group_size == 1:
        return lambda tensor: 0
    check_compression(compression, group_size)
    # COMPRESSED ALL-REDUCE CALL SITE (2/2): return modules.quant's fp16/int8 average here

    def average(tensor: torch.Tensor) -> int:
        before = comm.bytes_sent
        comm.all_reduce_sum(tensor, group, what)
        tensor /= group_size
        return comm.bytes_sent - before

    return average


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
