"""The multi-GPU rows of scripts/gpu_check.sh: NCCL across ranks, one GPU each.

Rows (named `multi-gpu: ...`): the NCCL all-reduce over every GPU used (1xN data parallel)
and a 2-stage NCCL pipeline against CPU; the int8 mean across 2 ranks on NCCL against the CPU
codec (bytes); DiLoCo int8 with --overlap (the training and the outer communicator of one
GPU) against CPU; a D = 2 shard group on ProcessGroupNCCL against CPU; fp16 across a 2-rank
NCCL pipeline against fp32; a killed rank: every survivor ends within --timeout-s with a
resumable checkpoint, and --resume continues to the end. With fewer than 2 GPUs each row is
a SKIP saying so (expected: not a failure of a one-GPU host).

    python -m torch.distributed.run --nproc-per-node 2 scripts/gpu_multi.py int8-mean OUT
runs the int8 row's worker (what the row itself starts).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    sys.path.insert(0, str(ROOT))

NCCL = ["--device", "cuda", "--comm", "nccl"]  # torchrun: GPU = $LOCAL_RANK; launch_local: i
KILL_TIMEOUT_S = 20
"""--timeout-s of the killed-rank row: the survivors must end within it (plus start-up)."""
ROWS = ("multi-gpu: NCCL all-reduce, 1xN, one GPU each, vs CPU",
        "multi-gpu: 2-stage NCCL pipeline, one GPU each, vs CPU",
        "multi-gpu: int8 mean across 2 ranks on NCCL = CPU codec",
        "multi-gpu: DiLoCo 1x2 int8 --overlap on NCCL (two communicators per GPU) vs CPU",
        "multi-gpu: D = 2 shard group on ProcessGroupNCCL vs CPU",
        "multi-gpu: fp16 across a 2-rank NCCL pipeline vs fp32",
        "multi-gpu: killed rank: survivors end within --timeout-s, --resume continues")


def skip_all(c, gpus: int) -> None:  # noqa: ANN001 - gpu_check.Checker
    """Every row a SKIP naming why (a host with fewer than 2 GPUs)."""
    for name in ROWS:
        c.add(name, "SKIP", time.monotonic(), f"needs 2 GPUs ({gpus} visible): NCCL across "
              "ranks cannot run here (NCCL refuses two ranks on one GPU)", expected=True)


def fail_all(c, why: str) -> None:  # noqa: ANN001
    """Every row a FAIL naming why none could run."""
    for name in ROWS:
        c.add(name, "FAIL", time.monotonic(), f"not run: {why}")


def multi_gpu_checks(c, t, gpus: int, pp_cpu) -> None:  # noqa: ANN001
    """Every multi-GPU row (gpu_check's Checker `c`, Trainer `t`; `pp_cpu`: the CPU run of the
    2-stage plan pp.json)."""
    if gpus < 2:
        skip_all(c, gpus)
        return
    g = sys.modules[type(t).__module__]  # gpu_check (as __main__ or imported)
    from formats.plan import Plan, SyncConfig, save_plan

    dp = t.plan("dp_n", [(0, 4)], [[r] for r in range(gpus)], 4, 2, SyncConfig())
    t0 = time.monotonic()
    g.compare(c, ROWS[0], t0,
              t.train("dp_nccl", dp, NCCL, torchrun=gpus), t.train("dp_cpu", dp, g.CPU),
              g.SAME_LOSS_REL)
    pp = c.out / "pp.json"
    t0 = time.monotonic()
    g.compare(c, ROWS[1], t0, t.train("pp_nccl", pp, NCCL, torchrun=2), pp_cpu, g.SAME_LOSS_REL)
    int8_mean_row(c)
    diloco = c.out / "diloco.json"
    flags, t0 = ["--overlap", "on", "--fragments", "2"], time.monotonic()
    g.compare(c, ROWS[3], t0, t.train("diloco_nccl", diloco, NCCL + flags, torchrun=2),
              t.train("diloco_cpu_ref", diloco, g.CPU + flags), g.SAME_LOSS_REL)
    shard = c.out / "shard2.json"
    save_plan(Plan("gpu-check", "", t.model, [(0, 4)], [[[0, 1]]], 4, 2, SyncConfig()), shard)
    t0 = time.monotonic()
    g.compare(c, ROWS[4], t0, t.train("shard_nccl", shard, NCCL, torchrun=2),
              t.train("shard_cpu", shard, g.CPU), g.SAME_LOSS_REL)
    t0 = time.monotonic()
    g.final_loss_row(c, ROWS[5], t0, t.train("pp_nccl_fp16", pp, NCCL + ["--precision", "fp16"],
                                               torchrun=2),
                     t.train("pp_nccl_fp32", pp, NCCL + ["--precision", "fp32"], torchrun=2))
    killed_rank_row(c, t, pp)


def int8_mean_row(c) -> None:  # noqa: ANN001
    """The worker below on 2 GPUs: both ranks end with the CPU reference's bytes."""
    t0, out = time.monotonic(), c.out / "int8_mean"
    code, text = c.run("int8_mean", [c.python, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node=2", str(Path(__file__)), "int8-mean",
                                     str(out)], 180)
    results = [out / f"rank{r}.json" for r in range(2)]
    if code != 0 or not all(p.exists() for p in results):
        c.add(ROWS[2], "FAIL", t0, f"exit {code}: {text.strip().splitlines()[-1:] or ['?']}")
        return
    got = [json.loads(p.read_text()) for p in results]
    ok = all(r["equal"] for r in got)
    c.add(ROWS[2], "PASS" if ok else "FAIL", t0, "; ".join(
        f"rank {r['rank']}: {r['numel']} values, {r['mismatches']} differ from the CPU codec's "
        f"mean (bytes sent {r['bytes']})" for r in got))


def killed_rank_row(c, t, pp: Path) -> None:  # noqa: ANN001
    """Rank 1 of the NCCL pipeline exits before step 4: rank 0 must end (status 1) within
    --timeout-s with its checkpoint of step 2; --resume on both then runs to the end."""
    import shutil

    t0, ckpt = time.monotonic(), c.out / "killed_ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    # the local launcher (one GPU per rank by default), --keep-going: the survivor is not
    # stopped by the launcher, it has to end on its own (torchrun would kill it at once)
    base = [c.python, "scripts/launch_local.py", "--plan", str(pp), "--keep-going", "--",
            "--steps", "6", "--seed", "0", "--fake-data", "--timeout-s", str(KILL_TIMEOUT_S),
            "--ckpt-dir", str(ckpt), "--ckpt-every", "2", *NCCL]
    code, text = c.run("killed_rank", [*base, "--debug-vanish", "1:4:1"],
                       KILL_TIMEOUT_S * 3 + 60)
    took = time.monotonic() - t0
    steps = sorted(ckpt.glob("rank0/step*.pt"))
    if code in (0, 124) or not steps:
        c.add(ROWS[6], "FAIL", t0, f"first run: exit {code} after {took:.0f} s (want a failure "
              f"within --timeout-s {KILL_TIMEOUT_S}), checkpoints of rank 0: {len(steps)}")
        return
    code2, text2 = c.run("killed_rank_resume", [*base, "--resume"], 240)
    resumed = "resumed from step" in text2
    status = "PASS" if code2 == 0 and resumed else "FAIL"
    c.add(ROWS[6], status, t0, f"rank 1 gone before step 4: the run ended with exit {code} in "
          f"{took:.0f} s (--timeout-s {KILL_TIMEOUT_S}), rank 0 kept {steps[-1].name}; "
          f"--resume: exit {code2}{', resumed' if resumed else ', did not resume'}")


def int8_mean_worker(out: Path) -> int:
    """One rank of the int8 row (under torchrun): the compressed mean of seeded inputs over an
    NCCL communicator of the 2 ranks, against reference_compressed_mean on CPU."""
    import os

    import torch
    import torch.distributed as dist

    from modules.comm import build_communicators
    from modules.quant.allreduce import reference_compressed_mean

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    comm = build_communicators([list(range(world))], rank, "nccl", store, device,
                               timeout_s=120)[tuple(range(world))]
    inputs = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(r))
              for r in range(world)]
    x = inputs[rank].to(device)
    sent = comm.mean_all_reduce(x, "int8")
    comm.synchronize("the int8 mean")
    want = reference_compressed_mean(inputs, "int8")
    got = x.cpu()
    mismatches = int((got.view(torch.int32) != want.view(torch.int32)).sum())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "numel": got.numel(), "mismatches": mismatches, "bytes": sent,
         "equal": mismatches == 0}))
    comm.close()
    dist.destroy_process_group()
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    if sys.argv[1:2] != ["int8-mean"] or len(sys.argv) != 3:
        sys.exit("usage: torchrun --nproc-per-node 2 scripts/gpu_multi.py int8-mean OUT")
    sys.exit(int8_mean_worker(Path(sys.argv[2])))
