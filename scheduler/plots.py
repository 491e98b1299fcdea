"""Pictures of a plan: devices by region coloured by stage with pipeline chains as edges, and
the search's convergence curve. matplotlib (Agg) only; imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from formats.atomic_io import atomic_write_with  # noqa: E402
from formats.cluster import Cluster  # noqa: E402
from formats.plan import Plan  # noqa: E402


def _device_positions(cluster: Cluster) -> dict[int, tuple[float, float]]:
    """Regions on a circle; a region's devices on a small circle around its centre."""
    regions = sorted(set(cluster.regions()))
    pos = {}
    for k, region in enumerate(regions):
        angle = 2 * np.pi * k / len(regions)
        cx, cy = 3 * np.cos(angle), 3 * np.sin(angle)
        members = [d.id for d in cluster.devices if d.region == region]
        for m, dev in enumerate(members):
            a = 2 * np.pi * m / max(1, len(members))
            pos[dev] = (cx + 0.6 * np.cos(a), cy + 0.6 * np.sin(a))
    return pos


def plot_plan(cluster: Cluster, plan: Plan, history: list[tuple[int, float]],
              path: str | Path) -> None:
    """Write a PNG with the assignment (left) and the convergence curve (right)."""
    fig, (ax, conv) = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [3, 2]})
    pos = _device_positions(cluster)
    cmap = plt.get_cmap("tab10" if plan.num_stages <= 10 else "viridis", plan.num_stages)
    for chain in plan.pipelines:
        xs, ys = zip(*(pos[d] for d in chain))
        ax.plot(xs, ys, "-", color="0.6", lw=0.8, zorder=1)
    for chain in plan.pipelines:
        for s, dev in enumerate(chain):
            ax.scatter(*pos[dev], color=cmap(s), s=60, zorder=2, edgecolor="k", lw=0.4)
    for region in sorted(set(cluster.regions())):
        pts = np.array([pos[d.id] for d in cluster.devices if d.region == region])
        ax.annotate(region, pts.mean(axis=0), ha="center", va="center", fontsize=8, alpha=0.7)
    handles = [plt.Line2D([], [], marker="o", ls="", color=cmap(s), label=f"stage {s}")
               for s in range(plan.num_stages)]
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    ax.set_title(f"{plan.model} on {plan.cluster}: chains as edges")
    ax.set_axis_off()
    if history:
        ev, cost = (list(x) for x in zip(*history))
        total = int(plan.search.get("evaluations", ev[-1]))
        if total > ev[-1]:  # carry the final best on to the end of the search
            ev.append(total)
            cost.append(cost[-1])
        conv.step(ev, cost, where="post")
        conv.set_xscale("log")
    conv.set_xlabel("evaluations")
    conv.set_ylabel(f"best {plan.predicted.get('objective', '')} cost (s)")
    conv.set_title("search convergence")
    fig.tight_layout()
    try:  # a unique temp name beside the target, never through a symlink
        atomic_write_with(path, lambda f: fig.savefig(f, format="png", dpi=90))
    finally:
        plt.close(fig)
