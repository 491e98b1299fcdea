"""Human-readable report of a simulated step (plots: scheduler/timeline.py, scheduler/plots.py)."""

from __future__ import annotations

from formats.plan import SyncConfig
from scheduler.simulator.step import SimResult


def sync_label(sync: SyncConfig, pipeline_compression: str = "none") -> str:
    """`diloco H=64 overlap F=2 W=100, dp int8, pp bf16`: a sync configuration in one line (W:
    the warm-up's all-reduce steps)."""
    mode = sync.mode
    if sync.rule.local_steps:
        mode += f" H={sync.inner_steps}" + (" overlap" if sync.overlap else "") + \
            (f" F={sync.fragments}" if sync.fragments > 1 else "") + \
            (f" W={sync.warmup_steps}" if sync.warmup_steps else "") + _outer_label(sync)
    return f"{mode}, dp {sync.compression}, pp {pipeline_compression}"


def _outer_label(sync: SyncConfig) -> str:
    """` outer lr 1 momentum 0` when the outer optimizer is not the default Nesterov one
    (the planner chooses it: plain averaging and Nesterov reach a loss at different steps)."""
    default = SyncConfig()
    if (sync.outer_lr, sync.outer_momentum) == (default.outer_lr, default.outer_momentum):
        return ""
    return f" outer lr {sync.outer_lr:g} momentum {sync.outer_momentum:g}"


def format_sim_table(result: SimResult) -> str:
    """Human-readable breakdown of a simulated step."""
    sync = result.sync
    rows = [
        ("step time", result.step_s),
        ("  compute (busiest device)", result.compute_s),
        ("  pipeline bubble", result.bubble_s),
        ("  exposed pipeline transfers", result.pp_comm_s),
        ("  tied-embedding gradient sum", result.tied_comm_s),
        ("  exposed data-parallel sync", result.dp_comm_s),
    ]
    lines = [f"{name:<32}{value:>12.3f} s" for name, value in rows]
    lines.append(f"{'hidden data-parallel sync':<32}{result.dp_hidden_s:>12.3f} s  (per step)")
    if sync.rule.local_steps:
        lines.append(f"{'outer sync per round':<32}{result.dp_sync_round_s:>12.3f} s  "
                     f"({result.dp_comm_round_s:.3f} exposed, "
                     f"{result.dp_sync_round_s - result.dp_comm_round_s:.3f} hidden)")
    if sync.warmup_steps:
        source = "the plan's predicted.train_steps" if result.train_steps_from == "plan" \
            else "the runner's --steps default"
        lines.append(f"{'run mean step (warm-up)':<32}{result.run_step_s:>12.3f} s  "
                     f"(the first {sync.warmup_steps} of {result.train_steps} steps at "
                     f"allreduce's {result.allreduce_step_s:.3f} s; {result.train_steps}: "
                     f"{source})")
    lines.append(f"{'slowest stage all-reduce':<32}{max(result.dp_allreduce_s, default=0):>12.3f}"
                 f" s  ({sync_label(sync, result.pipeline_compression)})")
    lines.append(f"{'pipeline bytes per step':<32}{result.pp_bytes_per_step / 1e6:>12.3f} MB")
    lines.append(f"{'data-parallel bytes per step':<32}{result.dp_bytes_per_step / 1e6:>12.3f} MB")
    if result.shard_degree > 1:
        by_stage = " ".join(str(d) for d in result.shard_degrees)
        lines.append(f"{'shard groups (FSDP)':<32}{by_stage:>12} devices each" +
                     (" (by stage)" if len(set(result.shard_degrees)) > 1 else ""))
        lines.append(f"{'  exposed FSDP collectives':<32}{result.fsdp_comm_s:>12.3f} s  "
                     f"(part of compute)")
        lines.append(f"{'  FSDP bytes per step':<32}"
                     f"{result.fsdp_bytes_per_step / 1e6:>12.3f} MB")
    lines.append(f"{'tokens per step':<32}{result.tokens_per_step:>12d}")
    lines.append(f"{'tokens/s':<32}{result.tokens_per_s:>12.1f}")
    split = " ".join(str(b - a) for a, b in result.stages)
    lines.append(f"{'layers per stage':<32}{split:>12}")
    worst = max(result.memory_gb, key=lambda x: x[1] / x[2], default=None)
    if worst:
        lines.append(f"{'fullest device memory':<32}{worst[1]:>9.2f} GB of {worst[2]:g} GB"
                     f" (device {worst[0]})")
    return "\n".join(lines)
