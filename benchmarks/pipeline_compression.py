"""Pipeline compression at equal tokens: none vs bf16 vs per-row int8 on the pipeline's links.

    python benchmarks/pipeline_compression.py [--steps 200] [--seeds 0,1,2] [--model gpt-tiny]
        [--precision fp32] [--modes none,bf16,int8]

Every run is dist_runner.py through the local launcher (a 2-stage pipeline, one replica, gloo
on 127.0.0.1, one thread per rank) on the real corpus; for each seed the runs of all modes have
the same initialisation, data order and steps, and only --pipeline-compression differs. Prints,
side by side: the final training loss (mean of the last 10 steps) and the final validation
loss, each averaged over the seeds and against `none`, the validation loss's range over the
seeds (the run-to-run noise a difference must beat), and the bytes the last stage sent on its
pipeline link per step (its activation gradients, the metrics' pp_bytes_sent; the first stage's
activations forward are the same size) against fp32.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from formats.models import get_model  # noqa: E402
from formats.plan import PIPELINE_COMPRESSIONS, Plan, save_plan  # noqa: E402
from modules.pipeline.wire import message_bytes  # noqa: E402
from modules.train.metrics import read_metrics  # noqa: E402


def run(mode: str, seed: int, plan_path: Path, args: argparse.Namespace, tmp: Path) -> dict:
    """One training run with --pipeline-compression `mode`; its losses and link bytes."""
    metrics = tmp / f"{mode}-{seed}.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/launch_local.py"), "--plan", str(plan_path),
         "--threads-per-rank", "1", "--", "--steps", str(args.steps), "--lr", str(args.lr),
         "--warmup-steps", str(args.warmup_steps), "--lr-schedule", "cosine",
         "--eval-sequences", str(args.eval_sequences), "--metrics", str(metrics),
         "--log-every", str(args.steps), "--seed", str(seed), "--precision",
         args.precision, "--pipeline-compression", mode, "--timeout-s", "120"]
        + (["--data", args.data] if args.data else []),
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"{mode} (seed {seed}) failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    recs = read_metrics(metrics)
    tail = recs[-10:]
    return {"train": sum(r["loss"] for r in tail) / len(tail), "val": recs[-1]["val_loss"],
            "pp_bytes": recs[-1]["pp_bytes_sent"], "tokens": recs[-1]["tokens"]}


def table(rows: dict[str, list[dict]], fp32_bytes: int) -> str:
    """The markdown table, every mode's seed means against `none`'s."""
    def mean(mode: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows[mode])

    lines = ["| pipeline compression | final train loss | vs none | val loss | vs none | "
             "val loss over seeds | link bytes/step | vs fp32 |", "|" + "---|" * 8]
    for mode, runs in rows.items():
        train, val = mean(mode, "train"), mean(mode, "val")
        d_train = f"{(train / mean('none', 'train') - 1) * 100:+.2f}%" if "none" in rows else "-"
        d_val = f"{(val / mean('none', 'val') - 1) * 100:+.2f}%" if "none" in rows else "-"
        vals = [r["val"] for r in runs]
        lines.append(f"| {mode} | {train:.4f} | {d_train} | {val:.4f} | {d_val} | "
                     f"{min(vals):.4f}..{max(vals):.4f} | {runs[0]['pp_bytes']} | "
                     f"{fp32_bytes / runs[0]['pp_bytes']:.2f}x smaller |")
    return "\n".join(lines)


def main() -> None:
    """Run every mode and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--eval-sequences", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--modes", default=",".join(PIPELINE_COMPRESSIONS),
                   help="comma-separated pipeline compressions, one row each")
    p.add_argument("--data", help="text file/folder (default: Debian fortunes)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one run each")
    args = p.parse_args()
    modes = args.modes.split(",")
    seeds = [int(v) for v in args.seeds.split(",")]
    if any(m not in PIPELINE_COMPRESSIONS for m in modes):
        sys.exit(f"--modes: each must be one of {', '.join(PIPELINE_COMPRESSIONS)}")
    spec = get_model(args.model)
    half = spec.num_layers // 2
    plan = Plan("local", "", args.model, [(0, half), (half, spec.num_layers)], [[0, 1]],
                micro_batch_size=args.micro_batch_size, num_micro_batches=args.micro_batches)
    shape = (args.micro_batch_size, spec.seq_len, spec.d_model)
    fp32_bytes = args.micro_batches * message_bytes("none", shape, 4)
    print(f"{args.model}, 2 stages, {args.steps} steps of {args.micro_batches} x "
          f"{args.micro_batch_size} sequences, --precision {args.precision}, seeds {seeds}")
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        save_plan(plan, Path(tmp) / "plan.json")
        for seed in seeds:
            for mode in modes:
                t0 = time.monotonic()
                rows[mode].append(run(mode, seed, Path(tmp) / "plan.json", args, Path(tmp)))
                print(f"  {mode} seed {seed}: val loss {rows[mode][-1]['val']:.4f} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"tokens per run: {rows[modes[0]][0]['tokens']}")
    print(table(rows, fp32_bytes))


if __name__ == "__main__":
    main()
