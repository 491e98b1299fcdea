#!/usr/bin/env python3
"""One PNG of a run folder (`dist_runner.py --run-dir DIR`): loss and validation loss against
tokens and against time, tokens/s and bytes sent per step, one line per replica.

    python scripts/plot_run.py RUN_DIR [--out run.png]

Default --out: RUN_DIR/run.png. The file is written atomically. Bad input exits 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from formats.atomic_io import atomic_write_with, check_output_path  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.run_metrics import load_run, number, replica_files  # noqa: E402


def series(recs: list[dict[str, Any]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have both numbers; x_key `time` is seconds since the first
    step began."""
    start = None
    if recs and number(recs[0], "wall_time") is not None:
        start = recs[0]["wall_time"] - (number(recs[0], "step_s") or 0.0)
    xs, ys = [], []
    for r in recs:
        x = (number(r, "wall_time") - start if x_key == "time" and start is not None
             and number(r, "wall_time") is not None else number(r, x_key))
        y = number(r, y_key)
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def replica_bytes(ranks: dict[int, list[dict[str, Any]]],
                  key: str = "bytes_sent") -> dict[int, dict[int, float]]:
    """{replica: {step: `key` bytes sent by all its ranks}} from the per-rank timing records."""
    out: dict[int, dict[int, float]] = {}
    for recs in ranks.values():
        for r in recs:
            sent = number(r, key)
            if isinstance(r.get("replica"), int) and sent is not None:
                per_step = out.setdefault(r["replica"], {})
                per_step[r["step"]] = per_step.get(r["step"], 0.0) + sent
    return out


def plot_run(replicas: dict[int, list[dict[str, Any]]], out: Path, title: str,
             ranks: dict[int, list[dict[str, Any]]] | None = None) -> None:
    """Draw the four panels and write the PNG atomically; bytes per step are every rank's of
    a replica when `ranks` (the per-rank records) are given, else its last stage's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [(axes[0, 0], "tokens", "tokens (this replica)", "loss"),
              (axes[0, 1], "time", "seconds since start", "loss"),
              (axes[1, 0], "step", "step", "tokens/s (all replicas)"),
              (axes[1, 1], "step", "step",
               "bytes sent per step (all ranks)" if ranks else "bytes sent per step (last stage)")]
    for ax, _, xlabel, ylabel in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for r, recs in sorted(replicas.items()):
        recs, color = sorted(recs, key=lambda x: x["step"]), f"C{r}"
        for ax, x_key in ((axes[0, 0], "tokens"), (axes[0, 1], "time")):
            ax.plot(*series(recs, x_key, "loss"), color=color, label=f"replica {r} loss")
            vx, vy = series(recs, x_key, "val_loss")
            if vx:
                ax.plot(vx, vy, "o--", color=color, label=f"replica {r} val_loss")
        axes[1, 0].plot(*series(recs, "step", "tokens_per_s"), color=color, label=f"replica {r}")
        if not ranks:
            axes[1, 1].plot(*series(recs, "step", "bytes_sent"), color=color,
                            label=f"replica {r} all")
            dx, dy = series(recs, "step", "dp_bytes_sent")
            if any(dy):
                axes[1, 1].plot(dx, dy, ":", color=color, label=f"replica {r} data-parallel")
    for key, style, what in (("bytes_sent", "-", "all"), ("dp_bytes_sent", ":", "data-parallel")):
        for r, per_step in sorted(replica_bytes(ranks or {}, key).items()):
            steps = sorted(per_step)
            if any(per_step.values()):
                axes[1, 1].plot(steps, [per_step[k] for k in steps], style, color=f"C{r}",
                                label=f"replica {r} {what}")
    for ax, *_ in panels:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        atomic_write_with(out, lambda f: fig.savefig(f, format="png", dpi=90))
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Plot a run folder."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's --run-dir")
    p.add_argument("--out", help="PNG to write (default RUN_DIR/run.png)")
    args = p.parse_args(argv)
    run = load_run(args.run_dir)
    damaged = sorted(p.name for p in replica_files(run.run_dir).values())
    if not run.replicas and damaged:
        raise UserError(f"RUN_DIR {args.run_dir}: {', '.join(damaged)} hold no readable "
                        "record with an integer step (damaged, or not a run's metrics)")
    if not run.replicas:
        raise UserError(f"RUN_DIR {args.run_dir}: no metrics.jsonl, only per-rank timing (the "
                        "run's --metrics went elsewhere, or --tracker left jsonl out)")
    if not any(series(recs, "step", "loss")[0] for recs in run.replicas.values()):
        raise UserError(f"RUN_DIR {args.run_dir}: no metrics record has a finite loss (damaged "
                        "metrics*.jsonl files?); nothing to plot")
    out = Path(args.out) if args.out else run.run_dir / "run.png"
    check_output_path(out, "--out", ".png")
    steps = max(len(v) for v in run.replicas.values())
    plot_run(run.replicas, out, f"{run.run_dir.name}: {len(run.replicas)} replica(s), "
             f"{steps} steps", run.ranks)
    print(f"wrote {out}")
    return 0


def entry() -> None:
    """Console entry point."""
    run_main(main)


if __name__ == "__main__":
    entry()
