"""DiLoCo vs all-reduce vs one replica on the real corpus: the OpenDiLoCo table at CPU scale.

    python benchmarks/diloco_convergence.py [--replicas 4] [--inner-steps H[,H...]] [--steps T]
                                            [--warm-start-steps S] [--sync-warmup W ...]
                                            [--out-dir D]

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
     fresh at the switch), once per --inner-steps H x --sync-warmup W x --outer
     LR:MOMENTUM[:COMPRESSION]; with W > 0 the run's first W steps all-reduce gradients (the
     plan's sync.warmup_steps, docs/bad_links.md) and DiLoCo starts from the weights at step W.
Prints validation loss and perplexity (per byte: byte-level tokens), tokens trained on (warm
start included), data-parallel bytes sent by all ranks after the switch (a ring all-reduce's
2 (n-1)/n x payload; modules.quant's wire bytes for int8; a warm-up's all-reduces included),
and wall time of each run. --out-dir D writes D/results.json ({"rows": [...]}: name, kind,
val_loss, ppl, dp_bytes, ...), rewritten after every row.
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

from formats.atomic_io import atomic_write_json  # noqa: E402
from formats.models import get_model  # noqa: E402
from formats.plan import Plan, SyncConfig, save_plan  # noqa: E402
from modules.config import OptimConfig, RunConfig  # noqa: E402
from modules.control.dist import topology  # noqa: E402
from modules.model.decoder import StageModel  # noqa: E402
from modules.sync.diloco import DiLoCoOptimizer  # noqa: E402
from modules.train.checkpoint import load_checkpoint, save_checkpoint, step_path  # noqa: E402
from modules.train.checkpointing import checkpoint_meta  # noqa: E402
from modules.train.metrics import read_metrics, replica_metrics_path  # noqa: E402
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


def parse_args() -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", default="10", help="H, or a comma list (one row set each)")
    p.add_argument("--steps", type=int, default=400,
                   help="optimizer steps of rows 1, 3, 4 (T), warm start included")
    p.add_argument("--warm-start-steps", type=int, default=100,
                   help="S: steps of one replica that every run starts from (0: from scratch)")
    p.add_argument("--sync-warmup", type=int, action="append", metavar="W",
                   help="DiLoCo rows with a warm-up of W gradient all-reduce steps (the plan's "
                   "sync.warmup_steps; repeatable; default 0)")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--outer", action="append", metavar="LR:MOMENTUM[:COMPRESSION]",
                   help="DiLoCo outer SGD settings, one row each (default: the papers' 0.7:0.9, "
                   "and 1.0:0 = plain parameter averaging); COMPRESSION none|fp16|int8")
    p.add_argument("--no-same-tokens", action="store_true",
                   help="skip row 2 (one replica with R x the steps: the slowest row)")
    p.add_argument("--no-single", action="store_true", help="skip the one-replica rows")
    p.add_argument("--no-allreduce", action="store_true",
                   help="skip the all-reduce row (another invocation ran it)")
    p.add_argument("--eval-sequences", type=int, default=512)
    p.add_argument("--data", help="text file/folder (default: Debian fortunes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, help="write OUT_DIR/results.json")
    return p.parse_args()


def configs_of(args: argparse.Namespace) -> list[tuple[str, str, Plan, int]]:
    """(label, kind, plan, steps) of every row, in run order."""
    T, S, R, b = args.steps, args.warm_start_steps, args.replicas, args.batch
    spec = get_model(args.model)
    one = lambda reps, sync: Plan("local", "", args.model, [(0, spec.num_layers)],
                                  [[r] for r in range(reps)], micro_batch_size=b,
                                  num_micro_batches=1, sync=sync)
    same_tokens = S + R * (T - S)
    configs = []
    if not args.no_single:
        configs.append((f"one replica, {T} steps", "single", one(1, SyncConfig()), T))
    if not (args.no_same_tokens or args.no_single):
        configs.append((f"one replica, {same_tokens} steps (same tokens)", "single",
                        one(1, SyncConfig()), same_tokens))
    if not args.no_allreduce:
        configs.append((f"{R} replicas all-reduce ({R}x batch)", "allreduce",
                        one(R, SyncConfig()), T))
    for H in (int(h) for h in args.inner_steps.split(",")):
        for W in args.sync_warmup or [0]:
            if (T - max(S, W)) % H:
                sys.exit(f"--steps minus the warm start / --sync-warmup {W} must be a multiple "
                         f"of H={H} (evaluate right after an outer step)")
            for outer in args.outer or ["0.7:0.9", "1.0:0"]:
                lr, momentum, *comp = outer.split(":")
                compression = comp[0] if comp else "none"
                label = (f"{R} replicas DiLoCo H={H}" + (f" W={W}" if W else "")
                         + f" outer {float(lr):g}/{float(momentum):g}"
                         + (f" {compression}" if compression != "none" else ""))
                sync = SyncConfig(mode="diloco", inner_steps=H, outer_lr=float(lr),
                                  outer_momentum=float(momentum), compression=compression,
                                  warmup_steps=W)
                configs.append((label, "diloco", one(R, sync), T))
    return configs


def write_rows(out_dir: Path | None, rows: list[tuple[str, str, dict]], args) -> None:
    """D/results.json: every row so far (rewritten after each run)."""
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "results.json", {"args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [{"name": label, "kind": kind, "val_loss": r["val_loss"],
                  "ppl": math.exp(r["val_loss"]), "dp_bytes": r["dp_bytes"],
                  "tokens": r["tokens"], "wall_s": round(r["wall_s"], 1)}
                 for label, kind, r in rows]})


def main() -> None:
    """Run the configurations and print the table."""
    args = parse_args()
    T, S, b = args.steps, args.warm_start_steps, args.batch
    if not 0 <= S < T:
        sys.exit("--warm-start-steps must be in [0, --steps)")
    if S and args.no_single:
        sys.exit("--no-single: only from scratch (--warm-start-steps 0; row 1 is the warm start)")
    spec = get_model(args.model)
    configs = configs_of(args)
    rows: list[tuple[str, str, dict]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        warm = None
        for i, (label, kind, plan, steps) in enumerate(configs):
            print(f"running {label} ...", file=sys.stderr, flush=True)
            extra: list[str] = []
            if i == 0 and S:  # the warm start: row 1 checkpoints at step S on its way to T
                extra = ["--ckpt-dir", str(tmp / "warm"), "--ckpt-every", str(S),
                         "--keep-checkpoints", str(T // S + 1)]
            elif S:
                extra = branch(warm, plan, args, tmp / f"ckpt{i}")
            rows.append((label, kind, run(f"run{i}", plan, steps, args, tmp, extra)))
            write_rows(args.out_dir, rows, args)
            if i == 0 and S:
                warm = load_checkpoint(step_path(tmp / "warm", 0, S), {})
    warm_tokens = S * b * spec.seq_len
    print(f"{args.model} on {'fortunes' if not args.data else args.data}, batch {b} x "
          f"{spec.seq_len} bytes per replica, AdamW lr {args.lr} ({args.warmup_steps} warm-up, "
          f"{args.lr_schedule} over {T} steps), seed {args.seed}; "
          + (f"every row continues one replica's first {S} steps; " if S else "")
          + f"validation on {args.eval_sequences} held-out sequences")
    print(f"{'':56s} {'tokens':>9s} {'val loss':>9s} {'ppl':>7s} {'DP bytes':>10s} "
          f"{'wall s':>7s}")
    for i, (label, _kind, r) in enumerate(rows):
        tokens = r["tokens"] + (warm_tokens if i and S else 0)
        print(f"{label:56s} {tokens:9d} {r['val_loss']:9.4f} {math.exp(r['val_loss']):7.3f} "
              f"{r['dp_bytes'] / 1e6:8.1f} MB {r['wall_s']:7.1f}")
    print_ratios(rows, args)


def print_ratios(rows: list[tuple[str, str, dict]], args: argparse.Namespace) -> None:
    """Each DiLoCo row's perplexity against all-reduce's and one replica's, and its bytes."""
    ppl = lambda x, y: math.exp(x["val_loss"] - y["val_loss"])
    ddp = next((r for _, kind, r in rows if kind == "allreduce"), None)
    if ddp is None:
        return
    singles = [r for _, kind, r in rows if kind == "single"]
    base = singles[0] if singles else None
    same = singles[1] if len(singles) > 1 else None
    for label, kind, dl in rows:
        if kind != "diloco":
            continue
        print(f"{label}: perplexity x{ppl(dl, ddp):.3f} of all-reduce's"
              + (f", x{ppl(dl, base):.3f} of one replica's" if base else "")
              + (f" (x{ppl(dl, same):.3f} at the same tokens)" if same else "")
              + f"; {ddp['dp_bytes'] / max(dl['dp_bytes'], 1):.1f}x fewer bytes than all-reduce")


if __name__ == "__main__":
    main()
