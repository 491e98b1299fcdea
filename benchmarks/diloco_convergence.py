"""DiLoCo vs all-reduce vs one replica on the real corpus: the OpenDiLoCo table at CPU scale.

    python benchmarks/diloco_convergence.py [--replicas 4] [--inner-steps H] [--steps T]
                                            [--warm-start-steps S]

Every run is dist_runner.py through the local launcher (one process per replica, gloo on
127.0.0.1, one thread each). As in the DiLoCo paper, the data-parallel runs start from a warm
(pre-trained) model: one replica, batch b, trains steps 1..S and checkpoints at step S; every
other row resumes from checkpoints of that state (written here in the runtime's format, so
dist_runner --resume takes them) and trains steps S+1..T, the data continuing where the warm
start stopped. The inner learning-rate schedule runs over T steps (row 2: over its own steps):
  1. one replica, batch b, to step T (the papers' single-worker baseline: the same steps);
  2. one replica, batch b, R x the steps after S (the same tokens as rows 3 and 4);
  3. R replicas with gradient all-reduce every step (DDP: R x b per step);
  4. R replicas with DiLoCo (each batch b, H inner AdamW steps, outer Nesterov SGD, starting
     fresh at the switch), once per --outer LR:MOMENTUM[:COMPRESSION].
Prints validation loss and perplexity (per byte: byte-level tokens), tokens trained on (warm
start included), data-parallel bytes sent by all ranks after the switch (a ring all-reduce's
2 (W-1)/W x payload; modules.quant's wire bytes for int8), and wall time of each run.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    sys.path.insert(0, str(ROOT))

from formats.models import get_model  # noqa: E402
from formats.plan import Plan, SyncConfig, save_plan  # noqa: E402
from modules.config import OptimConfig, RunConfig  # noqa: E402
from modules.control.dist import topology  # noqa: E402
from modules.sync.diloco import DiLoCoOptimizer  # noqa: E402
from modules.train.checkpoint import load_checkpoint, save_checkpoint, step_path  # noqa: E402
from modules.train.checkpointing import checkpoint_meta  # noqa: E402
from modules.train.metrics import read_metrics, replica_metrics_path  # noqa: E402
from modules.train.model import StageModel  # noqa: E402
from modules.train.trainer import make_inner_optimizer  # noqa: E402


def run(name: str, plan: Plan, steps: int, args: argparse.Namespace, tmp: Path,
        extra: list[str] = ()) -> dict:
    """Run one configuration to `steps`; return its final validation loss, bytes, wall time."""
    save_plan(plan, tmp / f"{name}.json")
    metrics = tmp / f"{name}.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/launch_local.py"), "--plan",
         str(tmp / f"{name}.json"), "--threads-per-rank", "1", "--", "--steps", str(steps),
         "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--lr-schedule",
         args.lr_schedule, "--eval-sequences", str(args.eval_sequences), "--metrics",
         str(metrics), "--log-every", str(steps), "--seed", str(args.seed), *extra]
        + (["--data", args.data] if args.data else []),
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    recs = [read_metrics(replica_metrics_path(metrics, r)) for r in range(plan.num_replicas)]
    val = sum(r[-1]["val_loss"] for r in recs) / len(recs)
    return {"val_loss": val, "tokens": sum(r[-1]["tokens"] for r in recs),
            "dp_bytes": sum(x["dp_bytes_sent"] for r in recs for x in r), "wall_s": wall}


def branch(warm: dict, plan: Plan, args: argparse.Namespace, ckpt_dir: Path) -> list[str]:
    """Checkpoints of the warm-start state for every rank of `plan`; returns the dist_runner
    flags that resume from them. All replicas get the warm model and AdamW state; DiLoCo's outer
    step starts fresh (anchor = the warm model, no momentum). Tokens and bytes count from 0."""
    spec = get_model(plan.model)
    model = StageModel(spec, 0, spec.num_layers, seed=None)
    model.load_state_dict(warm["model"])
    opt = make_inner_optimizer(model, RunConfig(steps=args.steps, optim=OptimConfig(lr=args.lr)))
    opt.load_state_dict(warm["opt"])
    if plan.sync.mode == "diloco":
        s = plan.sync
        opt = DiLoCoOptimizer(list(model.parameters()), opt, outer_lr=s.outer_lr,
                              outer_momentum=s.outer_momentum, inner_steps=s.inner_steps)
    state = {"step": warm["step"], "tokens": 0, "dp_bytes": 0, "model": model.state_dict(),
             "opt": opt.state_dict(), "rng": warm["rng"]}
    world = len(plan.devices())
    for rank in range(world):  # the runtime's own checkpoint meta, so --resume accepts it
        meta = checkpoint_meta(plan, topology(plan, rank, world), args.seed)
        save_checkpoint(step_path(ckpt_dir, rank, warm["step"]), meta, state)
    return ["--ckpt-dir", str(ckpt_dir), "--resume", "--keep-checkpoints", "1"]


def main() -> None:
    """Run the configurations and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--steps", type=int, default=400,
                   help="optimizer steps of rows 1, 3, 4 (T), warm start included")
    p.add_argument("--warm-start-steps", type=int, default=100,
                   help="S: steps of one replica that every run starts from (0: from scratch)")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--outer", action="append", metavar="LR:MOMENTUM[:COMPRESSION]",
                   help="DiLoCo outer SGD settings, one row each (default: the papers' 0.7:0.9, "
                   "and 1.0:0 = plain parameter averaging); COMPRESSION none|fp16|int8")
    p.add_argument("--no-same-tokens", action="store_true",
                   help="skip row 2 (one replica with R x the steps: the slowest row)")
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--data", help="text file/folder (default: Debian fortunes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    T, S, R, b, H = args.steps, args.warm_start_steps, args.replicas, args.batch, args.inner_steps
    if not 0 <= S < T:
        sys.exit("--warm-start-steps must be in [0, --steps)")
    if (T - S) % H:
        sys.exit("--steps minus --warm-start-steps must be a multiple of --inner-steps "
                 "(evaluate right after an outer step)")
    spec = get_model(args.model)
    one = lambda reps, sync: Plan("local", "", args.model, [(0, spec.num_layers)],
                                  [[r] for r in range(reps)], micro_batch_size=b,
                                  num_micro_batches=1, sync=sync)
    same_tokens = S + R * (T - S)
    configs = [(f"one replica, {T} steps", one(1, SyncConfig()), T)]
    if not args.no_same_tokens:
        configs.append((f"one replica, {same_tokens} steps (same tokens)",
                        one(1, SyncConfig()), same_tokens))
    ddp_label = f"{R} replicas all-reduce ({R}x batch)"
    configs.append((ddp_label, one(R, SyncConfig()), T))
    for outer in args.outer or ["0.7:0.9", "1.0:0"]:
        lr, momentum, *comp = outer.split(":")
        compression = comp[0] if comp else "none"
        label = f"{R} replicas DiLoCo H={H} outer {float(lr):g}/{float(momentum):g}"
        configs.append((label + (f" {compression}" if compression != "none" else ""),
                        one(R, SyncConfig(mode="diloco", inner_steps=H, outer_lr=float(lr),
                                          outer_momentum=float(momentum),
                                          compression=compression)), T))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        warm = None
        for i, (label, plan, steps) in enumerate(configs):
            print(f"running {label} ...", file=sys.stderr, flush=True)
            extra: list[str] = []
            if i == 0 and S:  # the warm start: row 1 checkpoints at step S on its way to T
                extra = ["--ckpt-dir", str(tmp / "warm"), "--ckpt-every", str(S),
                         "--keep-checkpoints", str(T // S + 1)]
            elif S:
                extra = branch(warm, plan, args, tmp / f"ckpt{i}")
            rows.append((label, run(f"run{i}", plan, steps, args, tmp, extra)))
            if i == 0 and S:
                warm = load_checkpoint(step_path(tmp / "warm", 0, S), {})
    warm_tokens = S * b * spec.seq_len
    print(f"{args.model} on {'fortunes' if not args.data else args.data}, batch {b} x "
          f"{spec.seq_len} bytes per replica, AdamW lr {args.lr} ({args.warmup_steps} warm-up, "
          f"{args.lr_schedule} over {T} steps), seed {args.seed}; "
          + (f"every row continues one replica's first {S} steps; " if S else "")
          + f"validation on {args.eval_sequences} held-out sequences")
    print(f"{'':48s} {'tokens':>9s} {'val loss':>9s} {'ppl':>7s} {'DP bytes':>10s} "
          f"{'wall s':>7s}")
    for i, (label, r) in enumerate(rows):
        tokens = r["tokens"] + (warm_tokens if i and S else 0)
        print(f"{label:48s} {tokens:9d} {r['val_loss']:9.4f} {math.exp(r['val_loss']):7.3f} "
              f"{r['dp_bytes'] / 1e6:8.1f} MB {r['wall_s']:7.1f}")
    res = dict(rows)
    base, ddp = rows[0][1], res[ddp_label]
    same = None if args.no_same_tokens else rows[1][1]
    ppl = lambda x, y: math.exp(x["val_loss"] - y["val_loss"])
    for label, dl in rows[list(res).index(ddp_label) + 1:]:
        print(f"{label}: perplexity x{ppl(dl, ddp):.3f} of all-reduce's, x{ppl(dl, base):.3f} "
              "of one replica's" + (f" (x{ppl(dl, same):.3f} at the same tokens)" if same else "")
              + f"; {ddp['dp_bytes'] / max(dl['dp_bytes'], 1):.1f}x fewer bytes than all-reduce")

if __name__ == "__main__":
    main()
