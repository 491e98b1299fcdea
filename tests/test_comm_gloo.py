"""GlooCommunicator over subgroups with 3 real processes: every call, global-rank peers, bytes,
and the compressed all-reduce through a Communicator (same bytes as through the group)."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modules.comm import (
    CommError,
    Communicator,
    GlooCommunicator,
    agree_int,
    build_communicators,
    compressed_all_reduce_mean,
)

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


# -- the runtime's use: peers by device id, posted receives, shared stats, one timeout ---------
IDS = (2, 5, 7)  # device ids of a later generation whose default group numbers them 0..2


def _ids_worker(rank: int, port: int, out_dir: str) -> None:
    from modules.comm import CommStats, PeerError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    me = IDS[rank]
    stats = CommStats()
    res: dict = {}
    try:
        world = GlooCommunicator(None, 30, ids=IDS, stats=stats)
        comms = build_communicators([[2, 7], [5, 7]], me, "gloo", timeout_s=1.5,
                                    rank_of={d: i for i, d in enumerate(IDS)}, stats=stats)
        res["ranks"] = [world.rank, list(world.ranks)]
        if me == 2:  # receives posted first, waited on out of order, tags keep them apart
            posted = [world.irecv(torch.empty(3), 7, tag=t) for t in (0, 1, 2)]
            res["tags"] = [world.wait(posted[i]).tolist() for i in (2, 0, 1)]
        elif me == 7:
            for t in (2, 1, 0):
                world.send(torch.full((3,), float(t)), 2, tag=t)
        world.barrier()
        res["stats_bytes"] = stats.bytes_sent
        res["own_bytes"] = world.bytes_sent
        if me != 5:  # rank 5 stays out: a mean over [2, 7] and then one over [5, 7] wait on it
            pair = comms[(2, 7)]
            x = torch.full((1000,), float(me))
            res["mean"] = pair.mean_all_reduce(x, "int8", "all-reduce of stage 0")
            res["mean_value"] = float(x[0])
        if me == 7:
            t0 = time.monotonic()
            try:
                comms[(5, 7)].mean_all_reduce(torch.ones(1000), "int8", "all-reduce of stage 1")
            except PeerError as e:
                res["error"] = [type(e).__name__, str(e), e.op, list(e.peers)]
            res["error_s"] = time.monotonic() - t0
        res["wait_s"] = stats.wait_s
        if me != 5:  # rank 2 busy for longer than the pair's 1.5 s: agree_int's own wait
            pair = comms[(2, 7)]
            time.sleep(4.0 if me == 2 else 0.0)
            t0 = time.monotonic()
            res["agreed"] = agree_int(pair, me, "max", "agreeing on a step", timeout_s=30)
            res["agree_s"] = time.monotonic() - t0
            res["timeout_after"] = pair.timeout_s
    finally:
        with open(f"{out_dir}/ids{rank}.json", "w") as f:
            json.dump(res, f)
        # rank 5 must outlive rank 7's timeout, or rank 7 sees a closed connection instead
        time.sleep(3 if me == 5 else 0)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def id_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    mp.start_processes(_ids_worker, args=(_free_port(), str(d)), nprocs=WORLD,
                       start_method="spawn", join=True)
    return [json.loads((d / f"ids{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(120)
def test_peers_are_named_by_id_and_posted_receives_match_by_tag(id_results):
    assert [r["ranks"] for r in id_results] == [[i, list(IDS)] for i in IDS]
    assert id_results[0]["tags"] == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert id_results[2]["own_bytes"] == 3 * 12  # three 3-float messages
    assert id_results[2]["stats_bytes"] >= 36  # the rank's total (all its communicators)


@pytest.mark.timeout(120)
def test_compressed_mean_and_a_silent_peer_within_the_communicators_timeout(id_results):
    r2, r7 = id_results[0], id_results[2]
    assert r2["mean_value"] == r7["mean_value"] == pytest.approx(4.5, rel=1e-2)
    assert 0 < r2["mean"] < 1000 * 4  # int8 codes, not fp32
    kind, text, op, peers = r7["error"]
    assert kind == "CommError" and peers == [5]
    assert op == "all-reduce of stage 1 (int8, reduce-scatter)"
    assert text.startswith("all-reduce of stage 1 (int8, reduce-scatter): no answer from rank 5 "
                           "within 1.5 s")
    assert 1.4 < r7["error_s"] < 10  # the communicator's 1.5 s, not a default of minutes
    assert r7["wait_s"] >= 1.4  # the wait is accounted


@pytest.mark.timeout(120)
def test_agreeing_waits_longer_than_the_communicators_timeout_when_told(id_results):
    """agree_int(..., timeout_s=30) waits for a peer that comes 2.5+ s late on a
    communicator whose timeout is 1.5 s (a replica's part still in its outer round), and the
    communicator keeps its own timeout afterwards."""
    r2, r7 = id_results[0], id_results[2]
    assert r2["agreed"] == r7["agreed"] == 7
    assert r7["agree_s"] > 1.5
    assert r2["timeout_after"] == r7["timeout_after"] == 1.5
