"""What the communication layer needs for GPUs, tested on CPU where it can be: the backend
choice per group (a pure function, and through a real TCPStore), host staging for gloo, the
watchdog that gives NCCL a timeout, and the NCCL members' meeting; on a CUDA machine (marker
gpu) gloo carries CUDA tensors through pinned memory."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from formats.errors import UserError
from modules.comm import CommError, CommOptions, DeviceInfo, PeerError, choose_backend
from modules.comm.choice import announce_device, local_device, read_devices
from modules.comm.nccl import meet
from modules.comm.staging import host_buffer, needs_staging, stage_in, stage_out, to_host
from modules.comm.watchdog import Watchdog


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu(host: str, index: int, uuid: str = "", nccl: bool = True) -> DeviceInfo:
    return DeviceInfo("cuda", host, index, uuid, nccl)


CPU = DeviceInfo("cpu", "a")


# -- the choice --------------------------------------------------------------------------------
def test_auto_picks_nccl_only_for_cuda_ranks_on_distinct_gpus():
    devices = {0: _gpu("a", 0), 1: _gpu("a", 1), 2: _gpu("b", 0), 3: CPU,
               4: _gpu("a", 1), 5: _gpu("c", 0, nccl=False), 6: _gpu("d", 0, "GPU-x"),
               7: _gpu("e", 3, "GPU-x")}
    pick = lambda ranks: choose_backend("auto", "g", ranks, devices)  # noqa: E731
    assert pick([2, 0, 1]).backend == "nccl"  # same index on other hosts: distinct GPUs
    assert pick([0, 1]).reason == "CUDA ranks on distinct GPUs"
    assert pick([0, 1]).ranks == (0, 1)
    cpu = pick([0, 3])
    assert (cpu.backend, cpu.reason) == ("gloo", "rank(s) [3] not on a CUDA device")
    shared = pick([1, 4])  # one host, one index: one GPU
    assert shared.backend == "gloo" and "ranks 1 and 4 share one GPU (cuda:1 on host a)" \
        in shared.reason
    assert "share one GPU" in pick([6, 7]).reason  # the uuid says so across "hosts"
    assert pick([0, 5]).reason == "rank(s) [5] cannot import cupy's NCCL"
    assert choose_backend("gloo", "g", [0, 1], devices).describe() == "g [0, 1]: gloo (requested)"
    assert choose_backend("nccl", "stage1", [1, 0], devices).reason == "requested"
    with pytest.raises(UserError, match=r"--comm nccl: group stage1 \[0, 3\] cannot use NCCL: "
                                        r"rank\(s\) \[3\] not on a CUDA device"):
        choose_backend("nccl", "stage1", [3, 0], devices)


def test_options_and_device_records_are_checked_and_round_trip():
    with pytest.raises(UserError, match="--comm: 'mpi' is not one of auto, gloo, nccl"):
        CommOptions("mpi")
    with pytest.raises(UserError, match="--device: 'gpu'"):
        CommOptions("auto", "gpu")
    with pytest.raises(UserError, match="--device: 'meta'"):
        CommOptions("auto", "meta")
    assert CommOptions("nccl", "cuda:1").device == "cuda:1"
    info = _gpu("h", 2, "GPU-1234")
    assert DeviceInfo.from_json(info.to_json()) == info
    me = local_device("cpu")
    assert me.kind == "cpu" and me.host == socket.gethostname() and not me.nccl


@pytest.mark.timeout(60)
def test_every_rank_computes_the_same_choices_from_the_store():
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, 4, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    devices = [_gpu("a", 0), _gpu("a", 1), CPU, _gpu("a", 1)]
    groups = [("stage0", (0, 1)), ("stage1", (2, 3)), ("pipeline0", (0, 2)),
              ("pipeline1", (1, 3)), ("tied", (0, 1, 3))]
    seen: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False,
                              timeout=timedelta(seconds=20))
        time.sleep(0.05 * (3 - r))  # announce in a scrambled order
        announce_device(store, r, devices[r])
        got = read_devices(store, range(4), 10)
        seen[r] = [choose_backend("auto", n, ranks, got).describe() for n, ranks in groups]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 4 and all(seen[r] == seen[0] for r in range(4))
    assert [d.split(": ")[1].split(" ")[0] for d in seen[0]] == \
        ["nccl", "gloo", "gloo", "gloo", "gloo"]
    del master


@pytest.mark.timeout(60)
def test_a_rank_that_never_announces_its_device_is_named():
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    announce_device(store, 0, CPU)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"rank\(s\) \[1\] did not announce their device within "
                                        "0.5 s"):
        read_devices(store, [0, 1], 0.5)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_a_store_that_goes_away_while_devices_are_read_is_named_not_a_late_rank():
    """The store's host dies while a rank waits for the others' devices (a kill during start-up
    in the kill trials): the error says the store stopped answering, not that a rank was late."""
    import subprocess
    import sys
    port = _free_port()
    host = subprocess.Popen([sys.executable, "-c", (
        "import time, datetime, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, None, True, wait_for_workers=False); "
        "print('up', flush=True); time.sleep(60)")], stdout=subprocess.PIPE)
    try:
        assert host.stdout.readline().strip() == b"up"
        store = dist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False,
                              timeout=timedelta(seconds=10))
        announce_device(store, 0, CPU)
        threading.Timer(0.5, host.kill).start()
        with pytest.raises(PeerError, match="the rendezvous store stopped answering") as e:
            read_devices(store, [0, 1], 5)
        assert "did not announce" not in str(e.value)
    finally:
        host.kill()
        host.wait()


@pytest.mark.timeout(60)
def test_nccl_members_meet_or_the_missing_one_is_named():
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    met = []
    other = threading.Thread(target=lambda: (meet(dist.TCPStore(
        "127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=10)), "p", 2, (0, 2),
        5), met.append(2)))
    other.start()
    meet(master, "p", 0, (0, 2), 5)
    other.join(10)
    assert met == [2]
    with pytest.raises(CommError, match=r"rank\(s\) \[1\] did not come within 0.5 s") as e:
        meet(master, "q", 0, (0, 1), 0.5)
    assert e.value.peers == (1,) and e.value.op == "NCCL init"


# -- staging -----------------------------------------------------------------------------------
def test_cpu_tensors_are_used_in_place_and_staged_copies_are_independent():
    t = torch.arange(12.0)
    assert not needs_staging(t) and to_host(t) is t and host_buffer(t) is t
    view = t.view(3, 4).t()  # not contiguous
    host = stage_out(view, pin=False)
    assert host.is_contiguous() and host.shape == view.shape and torch.equal(host, view)
    t.zero_()
    assert host.sum() == 66  # a copy, not a view of the source
    target = torch.zeros(4, 3)
    stage_in(host, target)
    assert torch.equal(target, host)


def _gloo_cuda_worker(rank: int, port: int, out: str) -> None:
    from modules.comm import GlooCommunicator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    comm = GlooCommunicator(None, 30)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    x = torch.full((1000,), float(rank + 1), device=dev)
    comm.all_reduce(x)
    got = torch.empty(5, device=dev)
    posted = comm.irecv(got, 1 - rank, tag=3)
    comm.send(torch.arange(5.0, device=dev) * (rank + 1), 1 - rank, tag=3)
    comm.wait(posted)
    y = torch.randn(4097, generator=torch.Generator().manual_seed(rank)).to(dev)
    comm.mean_all_reduce(y, "int8")
    res = {"sum": float(x[0]), "dev": str(x.device), "p2p": got.tolist(),
           "mean": y.cpu().tolist()[:3], "mean_dev": y.device.type}
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (staging of "
                    "CUDA tensors through pinned host memory)")
def test_gloo_carries_cuda_tensors_through_pinned_memory(tmp_path):
    mp.start_processes(_gloo_cuda_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert all(r["sum"] == 3.0 and r["dev"].startswith("cuda") for r in res)
    assert res[0]["p2p"] == [0.0, 2.0, 4.0, 6.0, 8.0] and res[1]["p2p"] == [0, 1, 2, 3, 4]
    assert res[0]["mean"] == res[1]["mean"] and res[0]["mean_dev"] == "cuda"


# -- the watchdog ------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_watchdog_aborts_a_stuck_operation_and_names_it():
    aborted, reported = [], []
    finished = threading.Event()
    dog = Watchdog(0.3, lambda: aborted.append(time.monotonic()), poll_s=0.01,
                   on_failure=reported.append)
    t0 = time.monotonic()
    dog.watch(finished.is_set, "quick one", [1])
    finished.set()
    dog.watch(lambda: True, "done at once", [1])
    dog.wait_all()  # both done: returns
    assert dog.failure is None and not aborted
    dog.watch(lambda: False, "all-reduce of stage 1", [0, 2])
    with pytest.raises(CommError) as e:
        dog.wait_all()
    assert 0.25 < time.monotonic() - t0 < 5 and len(aborted) == 1
    assert str(e.value).startswith("all-reduce of stage 1: no answer from rank(s) [0, 2] within "
                                   "0.3 s (NCCL has no timeout: the communicator was aborted)")
    assert e.value.peers == (0, 2) and reported == [e.value]
    with pytest.raises(CommError, match="all-reduce of stage 1"):
        dog.watch(lambda: True, "the next call", [1])  # later calls fail at once
    time.sleep(0.1)
    assert len(aborted) == 1  # aborted once
    dog.close()


@pytest.mark.timeout(30)
def test_watchdog_reports_a_failed_abort_and_keeps_slow_but_finished_work():
    def bad_abort() -> None:
        raise RuntimeError("ncclCommAbort: unhandled system error")

    dog = Watchdog(0.2, bad_abort, poll_s=0.01)
    start = time.monotonic()
    dog.watch(lambda: time.monotonic() - start > 0.1, "slow but in time", [3])
    time.sleep(0.4)
    assert dog.failure is None  # finished within the timeout: nothing to abort
    dog.watch(lambda: False, "receiving from rank 3", [3])
    time.sleep(0.5)
    assert dog.failure is not None and dog.failure.op == "receiving from rank 3"
    assert "aborting it failed too (ncclCommAbort: unhandled system error)" in str(dog.failure)
    dog.close()


# -- the group builder: choice per group, a later generation -----------------------------------
def _builder_worker(rank: int, port: int, out: str) -> None:
    from formats.plan import Plan
    from modules.comm import CommStats
    from modules.control.dist import topology
    from modules.control.groups import GroupBuilder

    torch.set_num_threads(1)
    plan = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1], [2, 3]])
    store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    topo, logs, stats = topology(plan, rank, 4), [], CommStats()
    builder = GroupBuilder(plan, topo, store, True, 30, stats, CommOptions("auto", "cpu"),
                           logs.append)
    groups = builder.build(0, [0, 1])
    t = torch.full((3,), float(rank))
    groups.stage.all_reduce(t, what="stage sum")
    u = torch.ones(2)
    groups.tied.all_reduce(u)
    res = {"choices": [c.describe() for c in groups.choices], "logs": logs,
           "stage": [list(groups.stage.ranks), t.tolist()], "tied": u.tolist(),
           "pipeline_is_world": groups.pipeline is groups.world,
           "world": list(groups.world.ranks), "bytes": stats.bytes_sent}
    try:
        GroupBuilder(plan, topo, store, True, 30, stats, CommOptions("nccl", "cpu")).build(
            0, [0, 1])
    except UserError as e:
        res["nccl"] = str(e)
    if topo.replica == 0:  # generation 1 without replica 1: a fresh default group of 2
        later = builder.build(1, [0])
        v = torch.full((1,), float(rank + 1))
        later.tied.all_reduce(v)
        res["gen1"] = [list(later.world.ranks), later.stage is None, v.tolist()]
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)
    time.sleep(0.5 if rank == 0 else 0)  # rank 0 hosts the store
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_group_builder_records_the_backend_of_each_group_and_reforms(tmp_path):
    mp.start_processes(_builder_worker, args=(_free_port(), str(tmp_path)), nprocs=4,
                       start_method="spawn", join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert res[0]["choices"] == ["stage0 [0, 2]: gloo (rank(s) [0, 2] not on a CUDA device)",
                                 "tied0 [0, 1]: gloo (rank(s) [0, 1] not on a CUDA device)",
                                 "pipeline0 [0, 1]: gloo (rank(s) [0, 1] not on a CUDA device)"]
    assert res[3]["choices"][0] == "stage1 [1, 3]: gloo (rank(s) [1, 3] not on a CUDA device)"
    assert res[0]["logs"][0] == "generation 0 backends: " + "; ".join(res[0]["choices"])
    assert res[0]["logs"][1].startswith("generation 1 backends: tied0 [0, 1]: gloo")
    assert res[0]["stage"] == [[0, 2], [2.0] * 3] and res[3]["stage"] == [[1, 3], [4.0] * 3]
    assert all(r["tied"] == [2.0, 2.0] and r["pipeline_is_world"] for r in res)
    assert all(r["world"] == [0, 1, 2, 3] and r["bytes"] > 0 for r in res)
    for r in res:  # every rank refuses the same way
        assert r["nccl"] == ("--comm nccl: group stage0 [0, 2] cannot use NCCL: rank(s) [0, 2] "
                             "not on a CUDA device; use --comm auto or gloo")
    assert res[0]["gen1"] == res[1]["gen1"] == [[0, 1], True, [3.0]]
    assert "gen1" not in res[2]
