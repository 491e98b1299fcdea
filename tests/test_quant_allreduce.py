"""Compressed mean all-reduce over gloo with 2-4 real processes: bound, identical bytes, bytes."""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modules.comm import compressed_all_reduce_mean
from modules.comm.base import GroupMembership
from modules.quant import NonFiniteError
from modules.quant.allreduce import SEGMENT as DEFAULT_SEGMENT
from modules.quant.allreduce import reference_compressed_mean

BLOCK = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(world: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(world * 1000 + n)
    return [torch.randn(n, generator=gen) * (r + 1) for r in range(world)]


SEGMENT = {10_001: 1000}  # these sizes run pipelined in several segments (not whole blocks)


def _segment(n: int) -> int:
    return SEGMENT.get(n, DEFAULT_SEGMENT)


CASES = {2: [(1000, "int8")],
         3: [(4097, "int8"), (2000, "none"), (2000, "fp16"), (10_001, "int8")],
         4: [(333, "int8"), (64 * 1024, "int8"), (64 * 1024, "fp16"), (10_001, "fp16")]}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        for n, compression in CASES[world]:
            x = _inputs(world, n)[rank].clone()
            sent = compressed_all_reduce_mean(x, None, compression, BLOCK, _segment(n))
            np.save(f"{out_dir}/{n}-{compression}-r{rank}.npy", x.numpy())
            np.save(f"{out_dir}/{n}-{compression}-sent{rank}.npy", np.array([sent]))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case of every world size once (one process group per world size)."""
    out = {}
    for world in CASES:
        d = tmp_path_factory.mktemp(f"w{world}")
        mp.start_processes(_worker, args=(world, _free_port(), str(d)), nprocs=world,
                           start_method="spawn", join=True)
        for n, comp in CASES[world]:
            out[(world, n, comp)] = (
                [np.load(d / f"{n}-{comp}-r{r}.npy") for r in range(world)],
                [int(np.load(d / f"{n}-{comp}-sent{r}.npy")[0]) for r in range(world)])
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,n", [(2, 1000), (3, 4097), (3, 10_001), (4, 333), (4, 64 * 1024)])
def test_int8_mean_is_within_bound_and_identical_everywhere(world, n, results):
    outs, sent = results[(world, n, "int8")]
    xs = _inputs(world, n)
    exact = torch.stack(xs).mean(0).numpy()
    # Bound: mean of the inputs' half-scales + half the reduced chunk's scale, per block.
    def half_scales(v: np.ndarray) -> np.ndarray:
        pad = np.pad(np.abs(v), (0, (-n) % BLOCK)).reshape(-1, BLOCK).max(1) / 127 / 2
        return np.repeat(pad, BLOCK)[:n]
    bound = sum(half_scales(x.numpy()) for x in xs) / world + half_scales(exact) * 1.01 + 1e-6
    assert (np.abs(outs[0] - exact) <= bound).all()
    for other in outs[1:]:
        assert other.tobytes() == outs[0].tobytes()
    assert all(s > 0 for s in sent)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [(w, n, c) for w, cases in CASES.items() for n, c in cases])
def test_every_rank_holds_the_single_process_reference_bytes(case, results):
    world, n, compression = case
    outs, _ = results[case]
    ref = reference_compressed_mean(_inputs(world, n), compression, BLOCK, _segment(n)).numpy()
    if compression == "none":  # gloo's own summation order: equal up to rounding only
        assert np.allclose(outs[0], ref, rtol=1e-6, atol=1e-6)
    else:
        assert all(o.tobytes() == ref.tobytes() for o in outs)


@pytest.mark.timeout(180)
def test_int8_sends_about_a_quarter_of_fp32(results):
    n, world = 64 * 1024, 4
    _, sent_int8 = results[(world, n, "int8")]
    fp32_ring = 2 * (world - 1) / world * 4 * n
    ratio = max(sent_int8) / fp32_ring
    assert 0.25 <= ratio < 0.27, ratio
    _, sent_fp16 = results[(world, n, "fp16")]
    assert 0.5 <= max(sent_fp16) / fp32_ring < 0.52


@pytest.mark.timeout(180)
def test_fp16_and_none_are_close_to_the_mean(results):
    n, world = 2000, 3
    exact = torch.stack(_inputs(world, n)).mean(0).numpy()
    outs, _ = results[(world, n, "none")]
    assert np.allclose(outs[0], exact, atol=1e-6)
    outs, _ = results[(world, n, "fp16")]
    assert np.allclose(outs[0], exact, rtol=2e-3, atol=2e-3)
    assert outs[1].tobytes() == outs[0].tobytes()


class _RecordingComm(GroupMembership):
    """A two-rank Communicator that records calls instead of talking to anyone."""

    def __init__(self) -> None:
        self._init_membership([0, 1], 0)
        self.device = torch.device("cpu")
        self.calls: list[str] = []

    def send(self, tensor, dst):  # noqa: ANN001, ANN201
        self.calls.append("send")

    def recv(self, tensor, src):  # noqa: ANN001, ANN201
        self.calls.append("recv")
        return tensor

    def exchange(self, sends, recvs):  # noqa: ANN001, ANN201
        self.calls.append("exchange")

    def all_reduce(self, tensor, op="sum"):  # noqa: ANN001, ANN201
        self.calls.append("all_reduce")

    def all_gather(self, outputs, tensor):  # noqa: ANN001, ANN201
        self.calls.append("all_gather")

    def broadcast(self, tensor, src):  # noqa: ANN001, ANN201
        self.calls.append("broadcast")

    def barrier(self):  # noqa: ANN201
        self.calls.append("barrier")


@pytest.mark.parametrize("compression", ["int8", "fp16"])
def test_non_finite_input_is_refused_before_anything_is_sent(compression):
    comm = _RecordingComm()
    x = torch.randn(5000)
    x[4321] = float("nan")
    with pytest.raises(NonFiniteError, match="all-reduce input: 1 NaN/inf values of 5000 "
                                             r"\(first at index 4321"):
        compressed_all_reduce_mean(x, comm, compression, BLOCK, segment=1024)
    assert comm.calls == [] and comm.bytes_sent == 0


def test_bad_arguments_are_named():
    comm = _RecordingComm()
    with pytest.raises(ValueError, match="compression: 'int4'"):
        compressed_all_reduce_mean(torch.zeros(4), comm, "int4")
    with pytest.raises(ValueError, match="float32"):
        compressed_all_reduce_mean(torch.zeros(4, dtype=torch.float64), comm, "int8")
