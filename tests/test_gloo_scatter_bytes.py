"""What the simulator's FSDP model assumes of gloo (scheduler/simulator/sharded.py GLOO_SCATTER):
a reduce-scatter puts twice an all-gather's bytes on the wire (gloo runs it as a whole
all-reduce). Measured on loopback's byte counter; if a torch release gives gloo a ring
reduce-scatter this fails, and GLOO_SCATTER should become 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scheduler.simulator.sharded import GLOO_SCATTER
from testkit.fault_harness import free_port

LO = Path("/sys/class/net/lo/statistics/tx_bytes")
RANKS, FLOATS = 3, 1 << 20
"""3 ranks, each with a 4 MB shard: 8 MB of a ring all-gather on the wire in all."""


def _sent() -> int:
    return int(LO.read_text())


def _rank(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    shard, full = torch.ones(FLOATS), torch.ones(FLOATS * RANKS)
    for name, call in (("gather", lambda: dist.all_gather_into_tensor(full, shard)),
                       ("scatter", lambda: dist.reduce_scatter_tensor(shard, full))):
        dist.barrier()
        before = _sent()
        call()
        dist.barrier()
        if rank == 0:
            out[name] = _sent() - before
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not LO.exists(), reason="no /sys/class/net/lo byte counter to measure with")
def test_gloos_reduce_scatter_moves_twice_an_all_gathers_bytes():
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank, args=(free_port(), out), nprocs=RANKS)
    ratio = out["scatter"] / out["gather"]
    assert out["gather"] >= (RANKS - 1) * FLOATS * 4  # the ring all-gather's bytes at least
    assert ratio == pytest.approx(GLOO_SCATTER, rel=0.1), out
