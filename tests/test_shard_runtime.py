"""Shard groups in the runtime (issue 22): a stage held by D devices with FSDP2 over gloo.

Every case starts real dist_runner ranks through scripts/launch_local.py (CPU, one thread per
rank) on seeded fake tokens, and compares with a single-process reference:
- FSDP2-sharded stages train exactly like the unsharded model on the same global batch
  (allreduce, 1 and 2 stages);
- DiLoCo across replicas, averaged shard by shard, equals the DiLoCo rule written serially;
- resume from per-shard checkpoints is bit-identical; another D is refused naming both;
- a device lost inside a replica ends that replica (its peer says why), the other finishes.
"""

from __future__ import annotations

import json

import pytest
import torch

from formats.models import get_model
from formats.plan import Plan, SyncConfig, save_plan
from modules.config import RunConfig
from modules.data.dataset import FakeData
from modules.model.decoder import StageModel, sync_local_tied_grads
from modules.quant.allreduce import reference_compressed_mean
from modules.train.checkpoint import step_path
from modules.train.trainer import make_inner_optimizer, set_lr
from testkit.reference import reference_losses
from tests.conftest import run_entry

MODEL, STEPS = "gpt-tiny", 4


def _launch(tmp_path, plan: Plan, *extra: str, name: str = "m", timeout: float = 200,
            launch: tuple[str, ...] = ()):
    """Every rank of `plan` (written to tmp_path); returns (process, metrics path)."""
    plan_path, metrics = tmp_path / "plan.json", tmp_path / f"{name}.jsonl"
    save_plan(plan, plan_path)
    proc = run_entry("scripts/launch_local.py", "--plan", str(plan_path),
                     "--threads-per-rank", "1", "--grace-s", "2", *launch, "--", "--fake-data",
                     "--metrics", str(metrics), "--timeout-s", "60", *extra, timeout=timeout)
    return proc, metrics


def _losses(metrics, replica: int = 0) -> list[float]:
    path = metrics if replica == 0 else metrics.with_suffix(f".r{replica}.jsonl")
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _data() -> FakeData:
    spec = get_model(MODEL)
    return FakeData(spec.seq_len, spec.vocab_size, seed=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages,sharded,flat,reshard", [
    ([(0, 4)], [[[0, 1]]], [[0], [1]], "on"),
    ([(0, 2), (2, 4)], [[[0, 1], [2, 3]]], [[0, 2], [1, 3]], "on"),
    ([(0, 2), (2, 4)], [[[0, 1], [2, 3]]], [[0, 2], [1, 3]], "off"),
], ids=["1-stage", "2-stages", "2-stages-gathered"])
def test_sharded_stages_train_like_the_unsharded_model(tmp_path, stages, sharded, flat,
                                                       reshard):
    plan = Plan("local", "", MODEL, stages, sharded, micro_batch_size=2, num_micro_batches=2)
    proc, metrics = _launch(tmp_path, plan, "--steps", str(STEPS), "--reshard-after-forward",
                            reshard)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "shard 1 of 2 of stage 0 with devices [0, 1] (FSDP2)" in out
    # allreduce without replicas: every byte sent is FSDP's (or the pipeline's)
    rec = json.loads(metrics.read_text().splitlines()[-1])
    assert rec["bytes_sent"] - rec["pp_bytes_sent"] > 0
    # FSDP2's collectives timed apart: in neither compute_s nor comm_s
    assert 0 < rec["fsdp_s"] < rec["step_s"]
    assert rec["compute_s"] + rec["comm_s"] + rec["fsdp_s"] == pytest.approx(rec["step_s"],
                                                                              abs=1e-5)
    got = torch.tensor(_losses(metrics), dtype=torch.float64)
    # the same global batch without shard groups: D lanes = D replicas of one device
    flat_plan = Plan("local", "", MODEL, stages, flat, micro_batch_size=2, num_micro_batches=2)
    torch.set_num_threads(1)
    want = torch.tensor(reference_losses(flat_plan, _data(), RunConfig(steps=STEPS)),
                        dtype=torch.float64)
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.timeout(400)
def test_a_compiled_sharded_stage_trains_like_the_unsharded_model(tmp_path):
    """--compile with shard groups (torch.compile of the stage, FSDP2 on the module inside it):
    on CPU (inductor with the host's C++ compiler) the losses match the unsharded reference
    as the eager run's do."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: torch.compile on CPU needs one (apt-get install g++)")
    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]]], micro_batch_size=2, num_micro_batches=2)
    proc, metrics = _launch(tmp_path, plan, "--steps", str(STEPS), "--compile", timeout=350)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "precision fp32, compiled" in out
    got = torch.tensor(_losses(metrics), dtype=torch.float64)
    flat = Plan("local", "", MODEL, [(0, 4)], [[0], [1]], micro_batch_size=2, num_micro_batches=2)
    torch.set_num_threads(1)
    want = torch.tensor(reference_losses(flat, _data(), RunConfig(steps=STEPS)),
                        dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded,flat", [
    ([[[0, 1], [2]]], [[0, 2], [1, 3]]),
    ([[[0], [1, 2]]], [[0, 2], [1, 3]]),
], ids=["D=2,1", "D=1,2"])
def test_stages_of_different_d_train_like_the_unsharded_model(tmp_path, sharded, flat):
    """D per stage: the stage of D = 1 runs both lanes (its device talks to both devices of
    the D = 2 stage); an untied model (tied embeddings need the same D on both ends)."""
    config = {**get_model(MODEL).fields(), "name": "gpt-tiny-untied", "tie_embeddings": False}
    stages = [(0, 2), (2, 4)]
    plan = Plan("local", "", "gpt-tiny-untied", stages, sharded, micro_batch_size=2,
                num_micro_batches=2, model_config=config)
    proc, metrics = _launch(tmp_path, plan, "--steps", str(STEPS))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    got = torch.tensor(_losses(metrics), dtype=torch.float64)
    flat_plan = Plan("local", "", "gpt-tiny-untied", stages, flat, micro_batch_size=2,
                     num_micro_batches=2, model_config=config)
    torch.set_num_threads(1)
    want = torch.tensor(reference_losses(flat_plan, _data(), RunConfig(steps=STEPS)),
                        dtype=torch.float64)
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _serial_diloco(plan: Plan, cfg: RunConfig, lanes_per_replica: int,
                   anchors: dict[str, torch.Tensor] | None = None) -> list[list[float]]:
    """The rule, one process: R full models; each step replica r's inner AdamW on its lanes'
    batch; every H steps anchor <- outer Nesterov SGD step with mean_r(anchor - params_r) as
    the gradient (through the plan's codec: reference_compressed_mean), params_r <- anchor.
    `anchors` (if given) receives the final outer model by parameter name."""
    spec, data, sync = get_model(plan.model), _data(), plan.sync
    R, per_lane = plan.num_replicas, plan.num_micro_batches * plan.micro_batch_size
    models = [StageModel(spec, 0, spec.num_layers, seed=cfg.seed) for _ in range(R)]
    inners = [make_inner_optimizer(m, cfg) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=sync.outer_lr, momentum=sync.outer_momentum,
                            nesterov=True)
    losses: list[list[float]] = [[] for _ in range(R)]
    batch = R * lanes_per_replica * per_lane
    for step in range(cfg.steps):
        for r, (model, inner) in enumerate(zip(models, inners)):
            x, y = data.samples(step * batch + r * lanes_per_replica * per_lane,
                                lanes_per_replica * per_lane)
            inner.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            sync_local_tied_grads(model)  # two copies of the tied embedding, like a stage
            set_lr(inner, step, cfg)
            inner.step()
            losses[r].append(float(loss.detach()))
        if (step + 1) % sync.inner_steps == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    deltas = [a - list(m.parameters())[i] for m in models]
                    a.grad = reference_compressed_mean(deltas, sync.compression).view_as(a)
                outer.step()
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
    if anchors is not None:
        anchors.update(zip((n for n, _ in models[0].named_parameters()), anchor))
    return losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression,outer_state", [("none", "host"), ("fp16", "device")])
def test_per_shard_diloco_equals_the_serial_rule(tmp_path, compression, outer_state):
    """fp16: each device rounds its shard's pseudo-gradient to fp16 and the mean is rounded
    again (modules.quant.allreduce); elementwise, so per shard == on the whole model."""
    sync = SyncConfig(mode="diloco", inner_steps=2, compression=compression)
    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=sync)
    from modules.train.checkpoint import load_checkpoint

    proc, metrics = _launch(tmp_path, plan, "--steps", str(STEPS), "--outer-state", outer_state,
                            "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", str(STEPS))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # each device averages only its shard with the same shard of the other replica
    assert "bytes sent to stage group [0, 2]" in out and "stage group [1, 3]" in out, out
    torch.set_num_threads(1)
    anchors: dict[str, torch.Tensor] = {}
    want = _serial_diloco(plan, RunConfig(steps=STEPS), lanes_per_replica=2, anchors=anchors)
    for r in range(2):
        torch.testing.assert_close(torch.tensor(_losses(metrics, r), dtype=torch.float64),
                                   torch.tensor(want[r], dtype=torch.float64),
                                   rtol=1e-5, atol=0)
    # the last step is an outer step: device i holds shard i (dim-0 chunk i, as FSDP2 cuts)
    # of the serial outer model. Float noise between the two (summation order, amplified by
    # AdamW where a gradient is near 0) moves a few elements by up to ~3e-5; the codec's
    # rounding moves nearly all: measured, off by > 1e-8 in 0.5% (fp16) and 3.8% (none) of
    # the elements, and in 98.7% when an fp16 run is held against the exact mean
    off, total = 0, 0
    for rank in range(4):
        got = load_checkpoint(step_path(tmp_path / "ck", rank, STEPS),
                              {"shard_degree": 2})["model"]
        for name, full in anchors.items():
            diff = (got[name] - full.chunk(2)[rank % 2]).abs()
            assert float(diff.max()) < 1e-4, (rank, name, float(diff.max()))
            off, total = off + int((diff > 1e-8).sum()), total + diff.numel()
    assert off / total < 0.1, (off, total)


def test_fp16_precision_and_the_fp16_codec_resolve_with_shard_groups():
    """Both were refused before: --precision fp16 until its overflow flag was agreed over the
    whole replica (tests/test_precision.py, `..._in_one_shard_...`); fp16 itself needs CUDA."""
    import dataclasses

    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=SyncConfig("diloco", 2, "fp16"))
    cfg = RunConfig(steps=4)
    assert cfg.resolve(plan).plan.sync.compression == "fp16"
    fp16 = dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, precision="fp16"))
    assert fp16.resolve(plan).plan.is_sharded


@pytest.mark.timeout(400)
def test_resume_from_shard_checkpoints_is_bit_identical_and_another_d_is_refused(tmp_path):
    sync = SyncConfig(mode="diloco", inner_steps=2, compression="int8")
    plan = Plan("local", "", MODEL, [(0, 2), (2, 4)], [[[0, 1], [2, 3]]],
                micro_batch_size=2, num_micro_batches=1, sync=sync)
    ckpt = tmp_path / "ckpt"
    common = ("--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--keep-checkpoints", "5")
    full, m_full = _launch(tmp_path, plan, "--steps", str(STEPS), *common, name="full")
    assert full.returncode == 0, (full.stdout + full.stderr)[-3000:]
    for rank in range(4):  # drop steps 4 on every shard: resume from step 2
        step_path(ckpt, rank, 4).unlink()
    again, m_again = _launch(tmp_path, plan, "--steps", str(STEPS), "--resume", *common,
                             name="again")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "resumed from step 2" in again.stdout
    assert _losses(m_again) == _losses(m_full)[2:]  # bit-identical
    # the same devices as one stage of D = 4: refused, naming both degrees
    other = Plan("local", "", MODEL, [(0, 4)], [[[0, 1, 2, 3]]], micro_batch_size=2,
                 num_micro_batches=1, sync=sync)
    bad, _ = _launch(tmp_path, other, "--steps", str(STEPS), "--resume", *common, name="bad")
    assert bad.returncode == 2, (bad.stdout + bad.stderr)[-3000:]
    assert "written with shard degree D = 2, this run has D = 4" in bad.stdout + bad.stderr


@pytest.mark.timeout(300)
def test_a_device_lost_inside_a_replica_ends_that_replica_only(tmp_path):
    sync = SyncConfig(mode="diloco", inner_steps=2)
    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=sync)
    steps = 8
    proc, metrics = _launch(tmp_path, plan, "--steps", str(steps), "--debug-vanish", "3:4:1",
                            "--heartbeat-timeout-s", "3", "--min-replicas", "1",
                            launch=("--keep-going",))
    out = proc.stdout + proc.stderr
    # rank 3 (replica 1, shard 1) vanished before step 4; rank 2, its shard peer, stops
    # saying its replica was dropped; replica 0 (ranks 0 and 1) trains to the end
    assert "[rank 3] debug: vanishing before step 4" in out, out[-4000:]
    assert "dropped replica(s) 1: rank 3" in out, out[-4000:]
    rank2 = "\n".join(line for line in out.splitlines() if line.startswith("[rank 2]"))
    assert "dropped" in rank2, out[-4000:]
    assert "Traceback" not in rank2, rank2[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()][-1] == steps
    assert "[rank 0] done" in out and "[rank 1] done" in out, out[-4000:]


@pytest.mark.timeout(300)
def test_a_sharded_replica_joins_a_running_job_shard_by_shard(tmp_path):
    """2 replicas x D = 2, DiLoCo H = 4: replica 0 starts alone (--replicas 0), replica 1
    joins mid-run (--join); device i of the joiner receives shard i of the outer model from
    device i of replica 0, and after the last outer step both replicas hold the same shards.
    200 steps: from its start a joiner needs ~45 of replica 0's steps to be admitted on a
    loaded 2-core machine (python + torch start-up, rendezvous, its shard group, the next
    outer step); with 60 replica 0 could finish first and the joiners were never admitted."""
    from modules.train.checkpoint import load_checkpoint
    from testkit.fault_harness import Ranks, free_port, poll_exits

    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=SyncConfig("diloco", 4))
    save_plan(plan, tmp_path / "plan.json")
    ranks = Ranks(tmp_path / "plan.json", f"tcp://127.0.0.1:{free_port()}", tmp_path)
    common = ("--fake-data", "--steps", "200", "--timeout-s", "60", "--heartbeat-timeout-s", "5",
              "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "200", "--log-every", "4",
              "--metrics", str(tmp_path / "m.jsonl"))
    try:
        for r in (0, 1):
            ranks.start(r, "--replicas", "0", *common)
        assert ranks.wait_for_text(0, "step 12/200", 150), ranks.output(0)[-3000:]
        for r in (2, 3):
            ranks.start(r, "--join", *common)
        poll_exits(ranks, 200)
    finally:
        left = ranks.stop()
    logs = "\n".join(f"[rank {r}] {ranks.output(r)[-1500:]}" for r in range(4))
    assert left == [], logs
    assert {r: p.returncode for r, p in ranks.procs.items()} == {0: 0, 1: 0, 2: 0, 3: 0}, logs
    for joiner, source in ((2, 0), (3, 1)):
        assert (f"received the outer model and momentum of stage 0 from rank {source}"
                in ranks.output(joiner)), logs
    states = {r: load_checkpoint(step_path(tmp_path / "ck", r, 200),
                                 {"shard_degree": 2})["model"] for r in range(4)}
    for a, b in ((0, 2), (1, 3)):  # shard i of both replicas
        for k in states[a]:
            assert torch.equal(states[a][k], states[b][k]), (a, b, k)
    assert not all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # two shards



@pytest.mark.timeout(400)
def test_a_dropped_sharded_replica_rejoins_as_a_whole(tmp_path):
    """2 replicas x D = 2, DiLoCo H = 4: kill -9 rank 3 (replica 1, shard 1) mid-run; rank 2,
    its shard peer, stops saying its replica was dropped; replica 0 goes on; both devices of
    replica 1 started again with --join form their shard group again (a new incarnation under
    the same name), are admitted, and after the last outer step shard i of both replicas is
    bit-identical."""
    from modules.train.checkpoint import load_checkpoint
    from testkit.fault_harness import Ranks, free_port, poll_exits

    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=SyncConfig("diloco", 4))
    save_plan(plan, tmp_path / "plan.json")
    ranks = Ranks(tmp_path / "plan.json", f"tcp://127.0.0.1:{free_port()}", tmp_path)
    common = ("--fake-data", "--steps", "200", "--timeout-s", "60", "--heartbeat-timeout-s", "3",
              "--min-replicas", "1", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "200",
              "--log-every", "4", "--metrics", str(tmp_path / "m.jsonl"))
    try:
        for r in range(4):
            ranks.start(r, *common)
        assert ranks.wait_for_text(2, "outer_step 2:", 150), ranks.output(2)[-3000:]
        ranks.kill(3)
        assert ranks.procs[2].wait(60) == 1, ranks.output(2)[-3000:]
        first = {r: ranks.output(r) for r in (2, 3)}
        assert ranks.procs[0].poll() is None and ranks.procs[1].poll() is None
        for r in (2, 3):
            ranks.start(r, "--join", *common)
        poll_exits(ranks, 250)
    finally:
        left = ranks.stop()
    logs = "\n".join(f"[rank {r}] {ranks.output(r)[-1500:]}" for r in range(4))
    assert left == [], logs
    assert "my replica 1 was dropped" in first[2], first[2][-3000:]
    assert "Traceback" not in first[2], first[2][-3000:]
    assert "dropped replica(s) 1: rank 3" in ranks.output(0), logs
    assert {r: p.returncode for r, p in ranks.procs.items()} == {0: 0, 1: 0, 2: 0, 3: 0}, logs
    for joiner, source in ((2, 0), (3, 1)):
        assert (f"received the outer model and momentum of stage 0 from rank {source}"
                in ranks.output(joiner)), logs
    states = {r: load_checkpoint(step_path(tmp_path / "ck", r, 200),
                                 {"shard_degree": 2})["model"] for r in range(4)}
    for a, b in ((0, 2), (1, 3)):  # shard i of both replicas
        for k in states[a]:
            assert torch.equal(states[a][k], states[b][k]), (a, b, k)


@pytest.mark.timeout(200)
def test_torchrun_two_nodes_each_a_sharded_replica(tmp_path):
    """The seeds' launch: `torchrun --nnodes=2 --node_rank=N --nproc_per_node=2` twice (two
    "nodes" on loopback, static rendezvous), each node one replica of D = 2 (torchrun's
    global ranks 2N, 2N+1 = the plan's devices of replica N); DiLoCo across the nodes trains
    as the serial rule does."""
    import os
    import subprocess
    import sys

    from testkit.fault_harness import free_port
    from tests.conftest import ROOT

    plan = Plan("local", "", MODEL, [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                num_micro_batches=1, sync=SyncConfig(mode="diloco", inner_steps=2))
    save_plan(plan, tmp_path / "plan.json")
    port, metrics = free_port(), tmp_path / "m.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", ST_RUN_SECRET="ab" * 32)
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(ROOT / "dist_runner.py"), "--plan", str(tmp_path / "plan.json"), "--fake-data",
         "--steps", str(STEPS), "--threads", "1", "--metrics", str(metrics)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for n in (0, 1)]
    outs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "rank 3: shard 1 of 2 of stage 0 with devices [2, 3] (FSDP2)" in outs[1], outs[1]
    torch.set_num_threads(1)
    want = _serial_diloco(plan, RunConfig(steps=STEPS), lanes_per_replica=2)
    for r in range(2):
        torch.testing.assert_close(torch.tensor(_losses(metrics, r), dtype=torch.float64),
                                   torch.tensor(want[r], dtype=torch.float64),
                                   rtol=1e-5, atol=0)
