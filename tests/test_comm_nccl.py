"""cupy NCCL communicator: unique id through the TCPStore (no GPU needed), lazy cupy import,
and on a CUDA machine (marker gpu) every call plus the int8 all-reduce on the GPU path."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from modules.comm import CommError, Communicator, CupyNcclCommunicator
from modules.comm.nccl import decode_unique_id, encode_unique_id, share_unique_id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cupy_nccl() -> bool:
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def test_unique_id_round_trips_signed_chars():
    uid = tuple((i * 37) % 256 - 128 for i in range(128))
    data = encode_unique_id(uid)
    assert len(data) == 128 and decode_unique_id(data) == uid
    with pytest.raises(ValueError, match="128"):
        encode_unique_id((1, 2, 3))


@pytest.mark.timeout(60)
def test_first_rank_publishes_the_unique_id_and_the_others_read_it():
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, 4, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    made, got = [], {}
    uid = tuple((i * 5) % 256 - 128 for i in range(128))

    def make():
        made.append(1)
        return uid

    def member(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=False,
                              timeout=timedelta(seconds=20))
        got[r] = share_unique_id(store, "comm/test/0-1-2/nccl-unique-id", r == 0, make, 20)

    threads = [threading.Thread(target=member, args=(r,)) for r in (2, 1, 0)]  # readers first
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert made == [1] and got == {0: uid, 1: uid, 2: uid}
    del master


@pytest.mark.timeout(60)
def test_missing_first_rank_is_a_clear_error():
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    with pytest.raises(CommError, match="first rank did not publish it within 0.5 s"):
        share_unique_id(store, "comm/x/nccl-unique-id", False, lambda: (), 0.5)


@pytest.mark.skipif(_cupy_nccl(), reason="cupy with NCCL is installed: nothing to refuse")
def test_without_cupy_the_error_says_what_to_install():
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    from modules.comm.nccl import cupy_package

    with pytest.raises(CommError, match=cupy_package()):
        CupyNcclCommunicator([0], 0, store, "t", "cuda:0")


def _gpu_ready() -> bool:
    return _cupy_nccl() and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and cupy with NCCL (gpu extra)")
def test_single_gpu_communicator_every_call():
    """NCCL refuses two ranks on one GPU, so one GPU gives a group of one: each call still runs."""
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    comm = CupyNcclCommunicator([0], 0, store, "solo", "cuda:0", timeout_s=30)
    assert isinstance(comm, Communicator)
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    comm.all_reduce(t)
    assert t.tolist() == list(range(6))
    outs = [torch.empty(6, device="cuda")]
    comm.all_gather(outs, t)
    comm.broadcast(t, src=0)
    got = torch.empty(6, device="cuda")
    comm.exchange([(t, 0)], [(got, 0)])  # send to self inside one group call
    comm.barrier()
    assert outs[0].tolist() == t.tolist() == got.tolist()
    comm.close()


def _nccl_worker(rank: int, world: int, port: int, out: dict) -> None:
    from modules.comm import compressed_all_reduce_mean
    from modules.quant.allreduce import reference_compressed_mean

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    comm = CupyNcclCommunicator(range(world), rank, store, "dp", f"cuda:{rank}", 60)
    inputs = [torch.randn(100_003, generator=torch.Generator().manual_seed(r)) * (r + 1)
              for r in range(world)]
    x = inputs[rank].cuda()
    compressed_all_reduce_mean(x, comm, "int8")
    ref = reference_compressed_mean(inputs, "int8")
    torch.cuda.synchronize()
    assert x.cpu().numpy().tobytes() == ref.numpy().tobytes(), "GPU int8 mean != CPU reference"
    y = torch.full((1000,), float(rank), device=f"cuda:{rank}")
    comm.all_reduce(y)
    assert float(y[0]) == sum(range(world))


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _gpu_ready() or torch.cuda.device_count() < 2,
                    reason="needs 2+ CUDA devices and cupy with NCCL (one NCCL rank per GPU)")
def test_multi_gpu_int8_all_reduce_matches_the_cpu_reference():
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    mp.start_processes(_nccl_worker, args=(world, _free_port(), {}), nprocs=world,
                       start_method="spawn", join=True)


def _nccl_watchdog_worker(rank: int, port: int, out: str) -> None:
    import json
    import time

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    comm = CupyNcclCommunicator([0, 1], rank, store, "wd", dev, timeout_s=2)
    got = torch.zeros(4, device=dev)
    if rank == 0:
        comm.send(torch.arange(4.0, device=dev), 1, what="payload")
    else:
        comm.wait(comm.irecv(got, 0), "payload")  # a posted receive, enqueued on wait
    comm.synchronize()
    res: dict = {"got": got.tolist()}
    if rank == 0:  # rank 1 never joins this all-reduce: the watchdog must end it
        t0 = time.monotonic()
        comm.all_reduce(torch.ones(10, device=dev), what="lonely all-reduce")
        try:
            comm.synchronize()
        except CommError as e:
            res["error"] = [str(e), list(e.peers), time.monotonic() - t0]
        store.set("done", "1")
    else:
        store.wait(["done"], timedelta(seconds=60))
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(res, f)
    comm.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _gpu_ready() or torch.cuda.device_count() < 2,
                    reason="needs 2+ CUDA devices and cupy with NCCL (one NCCL rank per GPU)")
def test_nccl_posted_receive_and_a_silent_peer_within_the_timeout(tmp_path):
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_nccl_watchdog_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert res[1]["got"] == [0.0, 1.0, 2.0, 3.0]
    text, peers, seconds = res[0]["error"]
    assert text.startswith("lonely all-reduce: no answer from rank 1 within 2 s") and peers == [1]
    assert 1.9 < seconds < 20
