"""Data-parallel averaging of a stage group, and the tied-embedding gradient sum.

`make_group_average` is the single place where the payload is chosen: an fp32 all-reduce for
`none`, the communicator's fp16/int8 mean all-reduce otherwise; everything else calls the
function it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from modules.comm import Communicator

GroupAverage = Callable[[torch.Tensor], int]
"""Averages a flat fp32 tensor in place over a stage group; returns the bytes it sent."""


def no_average(tensor: torch.Tensor) -> int:
    """The average over a group of one: nothing to do, nothing sent."""
    return 0


def make_group_average(comm: Communicator | None, compression: str, what: str) -> GroupAverage:
    """The averaging function of one stage group (identity without a group or alone in it).

    Returns the bytes this rank put on the wire: for `none` what a ring all-reduce sends,
    2 (W-1)/W x 4 bytes per element; for fp16/int8 what the compressed mean sends. On NCCL the
    average is only enqueued when it returns: `complete(average, what)` waits for it.
    """
    if comm is None or comm.size == 1:
        return no_average
    return CommAverage(comm, compression, what)


@dataclass
class CommAverage:
    """The average over a stage group's communicator (a GroupAverage)."""

    comm: Communicator
    compression: str
    what: str

    def __call__(self, tensor: torch.Tensor) -> int:
        """Average `tensor` in place; the bytes this rank sent."""
        comm = self.comm
        if self.compression != "none":
            return comm.mean_all_reduce(tensor, self.compression, self.what)
        before = comm.bytes_sent
        comm.all_reduce(tensor, "sum", self.what)
        tensor /= comm.size
        return comm.bytes_sent - before

    def complete(self, what: str) -> None:
        """Block until the averages enqueued so far are done (NCCL: the stream has run them,
        within the timeout; gloo: they already are)."""
        self.comm.synchronize(what)


def complete(average: GroupAverage, what: str) -> None:
    """Wait until `average`'s enqueued work is done (nothing to wait for without a group)."""
    wait = getattr(average, "complete", None)
    if wait is not None:
        wait(what)


def average_grads(params: list[torch.nn.Parameter], average: GroupAverage) -> int:
    """Average the gradients of `params` with one flat all-reduce; returns bytes sent. The
    average is complete (NCCL: run on the stream by a healthy communicator, within the
    timeout) before any gradient takes it: an aborted all-reduce leaves garbage in `flat`."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    sent = average(flat)
    complete(average, "the gradient average")
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)
    return sent


def sum_tied_grads(pair: list[torch.nn.Parameter], comm: Communicator | None) -> None:
    """Give the tied embedding copies (first and last stage) the sum of their gradients."""
    if len(pair) == 2:  # both copies on this stage
        total = pair[0].grad + pair[1].grad
        pair[0].grad.copy_(total)
        pair[1].grad.copy_(total)
    elif len(pair) == 1 and comm is not None:
        comm.all_reduce(pair[0].grad, "sum", "tied-embedding gradient sum with the other end "
                                             "of my pipeline")
