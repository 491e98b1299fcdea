"""DiLoCo vs all-reduce vs one replica on the real corpus: the OpenDiLoCo table at CPU scale.

    python benchmarks/diloco_convergence.py [--replicas 4] [--inner-steps 25] [--steps 300]

Three runs of the same model for the same number of optimizer steps, each with dist_runner.py
through the local launcher (one process per replica, gloo on 127.0.0.1, one thread each):
  1. one replica, batch b;
  2. R replicas with gradient all-reduce every step (DDP: R x b per step);
  3. R replicas with DiLoCo (each batch b, H inner AdamW steps, outer Nesterov SGD), once per
   --outer LR:MOMENTUM (default: the papers' 0.7/0.9, and 1.0/0 = plain parameter averaging).
Runs 2 and 3 see the same tokens (R x run 1's); run 1 is the paper's single-worker baseline.
Prints validation loss and perplexity (per byte: byte-level tokens), data-parallel bytes sent
by all ranks (a ring all-reduce's 2 (W-1)/W x payload; modules.quant's wire bytes for int8),
and wall time.
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

from modules.metrics import read_metrics, replica_metrics_path  # noqa: E402
from scheduler.models import get_model  # noqa: E402
from scheduler.plan import Plan, SyncConfig, save_plan  # noqa: E402


def run(name: str, plan: Plan, args: argparse.Namespace, tmp: Path) -> dict:
    """Run one configuration; return its final validation loss, bytes and wall time."""
    save_plan(plan, tmp / f"{name}.json")
    metrics = tmp / f"{name}.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/launch_local.py"), "--plan",
         str(tmp / f"{name}.json"), "--threads-per-rank", "1", "--", "--steps", str(args.steps),
         "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--lr-schedule",
         args.lr_schedule, "--eval-sequences", str(args.eval_sequences), "--metrics",
         str(metrics), "--log-every", str(args.steps), "--seed", str(args.seed)]
        + (["--data", args.data] if args.data else []),
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    recs = [read_metrics(replica_metrics_path(metrics, r)) for r in range(plan.num_replicas)]
    val = sum(r[-1]["val_loss"] for r in recs) / len(recs)
    return {"name": name, "replicas": plan.num_replicas, "val_loss": val,
            "tokens": sum(r[-1]["tokens"] for r in recs),
            "dp_bytes": sum(x["dp_bytes_sent"] for r in recs for x in r), "wall_s": wall}


def main() -> None:
    """Run the three configurations and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=25, help="H")
    p.add_argument("--steps", type=int, default=300, help="optimizer (inner) steps of every run")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--outer", action="append", metavar="LR:MOMENTUM[:COMPRESSION]",
                   help="DiLoCo outer SGD settings, one row each (default: the papers' 0.7:0.9, "
                   "and 1.0:0 = plain parameter averaging); COMPRESSION none|fp16|int8")
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--data", help="text file/folder (default: Debian fortunes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps % args.inner_steps:
        sys.exit("--steps must be a multiple of --inner-steps (evaluate right after an outer step)")
    R, b = args.replicas, args.batch
    spec = get_model(args.model)
    one = lambda reps, sync: Plan("local", "", args.model, [(0, spec.num_layers)],
                                  [[r] for r in range(reps)], micro_batch_size=b,
                                  num_micro_batches=1, sync=sync)
    configs = [
        ("one replica", one(1, SyncConfig())),
        (f"{R} replicas all-reduce ({R}x batch)", one(R, SyncConfig())),
    ]
    for outer in args.outer or ["0.7:0.9", "1.0:0"]:
        lr, momentum, *comp = outer.split(":")
        compression = comp[0] if comp else "none"
        label = f"{R} replicas DiLoCo H={args.inner_steps} outer {float(lr):g}/{float(momentum):g}"
        configs.append((label + (f" {compression}" if compression != "none" else ""),
                        one(R, SyncConfig(mode="diloco", inner_steps=args.inner_steps,
                                          outer_lr=float(lr), outer_momentum=float(momentum),
                                          compression=compression))))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, (label, plan) in enumerate(configs):
            print(f"running {label} ...", file=sys.stderr, flush=True)
            rows.append((label, run(f"run{i}", plan, args, Path(d))))
    print(f"{args.model} on {'fortunes' if not args.data else args.data}, {args.steps} steps, "
          f"batch {b} x {spec.seq_len} bytes per replica, AdamW lr {args.lr} ({args.warmup_steps} "
          f"warm-up, {args.lr_schedule}), seed {args.seed}; validation on "
          f"{args.eval_sequences} held-out sequences")
    print(f"{'':45s} {'tokens':>9s} {'val loss':>9s} {'ppl':>7s} {'DP bytes':>10s} "
          f"{'wall s':>7s}")
    for label, r in rows:
        print(f"{label:45s} {r['tokens']:9d} {r['val_loss']:9.4f} {math.exp(r['val_loss']):7.3f} "
              f"{_mb(r['dp_bytes']):>10s} {r['wall_s']:7.1f}")
    base, ddp = rows[0][1], rows[1][1]
    for label, dl in rows[2:]:
        print(f"{label}: perplexity x{math.exp(dl['val_loss'] - ddp['val_loss']):.3f} of "
              f"all-reduce's and x{math.exp(dl['val_loss'] - base['val_loss']):.3f} of one "
              f"replica's; {ddp['dp_bytes'] / max(dl['dp_bytes'], 1):.1f}x fewer bytes than "
              "all-reduce")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


if __name__ == "__main__":
    main()
