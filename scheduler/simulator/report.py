"""Human-readable report of a simulated step (plots: scheduler/timeline.py, scheduler/plots.py)."""

from __future__ import annotations

from scheduler.simulator.step import SimResult


def format_sim_table(result: SimResult) -> str:
    """Human-readable breakdown of a simulated step."""
    sync = result.sync
    mode = sync.mode + (f", H={sync.inner_steps}" if sync.mode == "diloco" else "")
    rows = [
        ("step time", result.step_s),
        ("  compute (busiest device)", result.compute_s),
        ("  pipeline bubble", result.bubble_s),
        ("  exposed pipeline transfers", result.pp_comm_s),
        ("  tied-embedding gradient sum", result.tied_comm_s),
        ("  exposed data-parallel sync", result.dp_comm_s),
    ]
    lines = [f"{name:<32}{value:>12.3f} s" for name, value in rows]
    if sync.mode == "diloco":
        lines.append(f"{'  outer sync per round (exposed)':<32}{result.dp_comm_round_s:>12.3f} s")
    lines.append(f"{'slowest stage all-reduce':<32}{max(result.dp_allreduce_s, default=0):>12.3f}"
                 f" s  ({mode}, {sync.compression})")
    lines.append(f"{'tokens per step':<32}{result.tokens_per_step:>12d}")
    lines.append(f"{'tokens/s':<32}{result.tokens_per_s:>12.1f}")
    split = " ".join(str(b - a) for a, b in result.stages)
    lines.append(f"{'layers per stage':<32}{split:>12}")
    worst = max(result.memory_gb, key=lambda x: x[1] / x[2], default=None)
    if worst:
        lines.append(f"{'fullest device memory':<32}{worst[1]:>9.2f} GB of {worst[2]:g} GB"
                     f" (device {worst[0]})")
    return "\n".join(lines)
