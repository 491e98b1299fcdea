"""GlooCommunicator over subgroups with 3 real processes: every call, global-rank peers, bytes,
and the compressed all-reduce through a Communicator (same bytes as through the group)."""

from __future__ import annotations

import json
import socket
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modules.comm import CommError, Communicator, GlooCommunicator, build_communicators
from modules.quant import compressed_all_reduce_mean

WORLD = 3
GROUPS = [[2, 0], [1], [0, 1, 2]]  # given unsorted on purpose: groups are kept sorted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    res: dict = {}
    try:
        comms = build_communicators(GROUPS, rank, "gloo", timeout_s=30)
        res["groups"] = sorted(list(k) for k in comms)
        res["is_protocol"] = all(isinstance(c, Communicator) for c in comms.values())
        full = comms[(0, 1, 2)]
        t = torch.full((5,), float(rank + 1))
        full.all_reduce(t)
        res["sum"] = t.tolist()
        t = torch.tensor([float(rank), -float(rank)])
        full.all_reduce(t, "max")
        res["max"] = t.tolist()
        outs = [torch.empty(2, dtype=torch.int64) for _ in range(3)]
        full.all_gather(outs, torch.tensor([rank, 10 * rank]))
        res["gather"] = [o.tolist() for o in outs]
        b = torch.tensor([rank * 1.5])
        full.broadcast(b, src=2)
        res["bcast"] = b.tolist()
        full.barrier()
        if (0, 2) in comms:  # p2p in the subgroup, peers named by global rank
            pair = comms[(0, 2)]
            before = pair.bytes_sent
            if rank == 2:
                pair.send(torch.arange(4.0), dst=0)
                got = pair.recv(torch.empty(3, dtype=torch.int32), src=0)
            else:
                got = pair.recv(torch.empty(4), src=2)
                pair.send(torch.tensor([7, 8, 9], dtype=torch.int32), dst=2)
            res["p2p"] = got.tolist()
            res["p2p_bytes"] = pair.bytes_sent - before
            try:
                pair.send(torch.zeros(1), dst=1)
            except ValueError as e:
                res["non_member"] = str(e)
            # compressed mean over the subgroup: through the Communicator and through the group
            x = torch.randn(1001, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
            y = x.clone()
            res["via_comm_sent"] = compressed_all_reduce_mean(x, pair, "int8", 64)
            compressed_all_reduce_mean(y, pair.group, "int8", 64)
            np.save(f"{out_dir}/sub-r{rank}.npy", x.numpy())
            res["same_as_group_path"] = x.numpy().tobytes() == y.numpy().tobytes()
        if (1,) in comms:
            t = torch.ones(3)
            res["single_sent"] = compressed_all_reduce_mean(t, comms[(1,)], "int8")
            res["single_value"] = t.tolist()
    finally:
        with open(f"{out_dir}/r{rank}.json", "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("comm")
    mp.start_processes(_worker, args=(_free_port(), str(d)), nprocs=WORLD, start_method="spawn",
                       join=True)
    return [json.loads((d / f"r{r}.json").read_text()) for r in range(WORLD)], d


@pytest.mark.timeout(120)
def test_membership_and_collectives(results):
    res, _ = results
    assert [r["groups"] for r in res] == [[[0, 1, 2], [0, 2]], [[0, 1, 2], [1]],
                                          [[0, 1, 2], [0, 2]]]
    for r in res:
        assert r["is_protocol"]
        assert r["sum"] == [6.0] * 5
        assert r["max"] == [2.0, 0.0]
        assert r["gather"] == [[0, 0], [1, 10], [2, 20]]
        assert r["bcast"] == [3.0]


@pytest.mark.timeout(120)
def test_point_to_point_by_global_rank(results):
    res, _ = results
    assert res[0]["p2p"] == [0.0, 1.0, 2.0, 3.0] and res[2]["p2p"] == [7, 8, 9]
    assert res[2]["p2p_bytes"] == 16 and res[0]["p2p_bytes"] == 12
    assert "rank 1 is not in this communicator's group [0, 2]" in res[0]["non_member"]


@pytest.mark.timeout(120)
def test_compressed_mean_through_a_communicator(results):
    res, d = results
    assert res[0]["same_as_group_path"] and res[2]["same_as_group_path"]
    a, b = np.load(d / "sub-r0.npy"), np.load(d / "sub-r2.npy")
    assert a.tobytes() == b.tobytes()
    x0 = torch.randn(1001, generator=torch.Generator().manual_seed(0)).numpy()
    x2 = torch.randn(1001, generator=torch.Generator().manual_seed(2)).numpy() * 3
    assert np.abs(a - (x0 + x2) / 2).max() < 3 * np.abs(x2).max() / 127
    # two ranks: each sends half its codes + scales twice (reduce-scatter, all-gather)
    assert 1001 <= res[0]["via_comm_sent"] <= 1001 + 4 * 16 + 64
    assert res[1]["single_sent"] == 0 and res[1]["single_value"] == [1.0] * 3


def test_gloo_communicator_needs_an_initialised_world():
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    with pytest.raises(CommError, match="init_process_group"):
        GlooCommunicator()


def test_build_communicators_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        build_communicators([[0]], 0, "mpi")
