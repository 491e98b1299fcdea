"""Gantt chart of a simulated step: one row per device, boxes for compute and transfers.

Each device row has an upper band for compute (forward blue, backward orange) and a lower band
for what it sends (pipeline activations/gradients grey, tied-embedding gradient sum purple,
all-reduce steps green; a transfer's box is the time it holds the link). Rows go in
pipeline order (replica 0's stages, then replica 1's, ...). Rendered with matplotlib's Agg
backend and written atomically.
"""

from __future__ import annotations

import io
from pathlib import Path

from formats.atomic_io import atomic_write_bytes
from scheduler.simulator import SimResult

COLORS = {"fwd": "#4878cf", "bwd": "#ee854a", "send": "#8c8c8c", "tied": "#956cb4",
          "allreduce": "#6acc65"}


def render_timeline_png(result: SimResult, title: str = "") -> bytes:
    """PNG bytes of the step's Gantt chart (needs a result simulated with timeline=True)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    order = [d for chain in result.pipelines for d in chain]
    row_of = {d: k for k, d in enumerate(order)}
    n_stages = len(result.stages)
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.28 * len(order) + 1.5)))
    bands: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for box in result.timeline:
        if box.device in row_of and box.end_s > box.start_s:
            bands.setdefault((box.device, box.kind), []).append(
                (box.start_s, box.end_s - box.start_s))
    for (dev, kind), spans in bands.items():
        y = row_of[dev]
        lower = kind not in ("fwd", "bwd")  # transfers
        ax.broken_barh(spans, (y + (0.05 if lower else -0.4), 0.35 if lower else 0.45),
                       facecolors=COLORS[kind], linewidth=0)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"r{k // n_stages} s{k % n_stages} dev {d}"
                        for k, d in enumerate(order)], fontsize=6)
    ax.invert_yaxis()
    ax.axvline(result.makespan_s, color="k", linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_title(title or f"step {result.step_s:.3f} s ({result.sync.mode}), "
                          f"{result.tokens_per_s:,.0f} tokens/s", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right",
              fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def save_timeline_png(result: SimResult, path: str | Path, title: str = "") -> None:
    """Write the Gantt chart to `path` atomically."""
    atomic_write_bytes(path, render_timeline_png(result, title))
