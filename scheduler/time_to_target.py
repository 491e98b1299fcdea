"""Time to a target loss in words: what `plan --sync auto`, `simulate` and `explain` print of a
plan's `predicted.to_target` (scheduler.sync_search.record_target), and the comparison of a
finished run's measured time to it. Pure: dicts in, lines out.
"""

from __future__ import annotations

from typing import Any

from scheduler.quality import OUT_OF_RANGE_MARGIN


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def target_rows(ours: dict[str, Any] | None, allreduce: dict[str, Any] | None) -> list[str]:
    """The headline lines of `plan --sync auto`: the target, then predicted time, steps and
    tokens to it of the chosen plan beside the best allreduce plan's (nothing when unknown)."""
    if not ours:
        return []
    rows = [f"  target: {ours['target']}"
            + (f" (validation loss {ours['loss']:.3f})" if ours.get("loss") is not None else "")]
    if allreduce and ours.get("seconds") and allreduce.get("seconds"):
        rows.append(f"  time to the target: {ours['seconds']:.1f} s against allreduce's "
                    f"{allreduce['seconds']:.1f} s: {allreduce['seconds'] / ours['seconds']:.2f}x "
                    f"sooner (predicted)")
    for label, d in (("chosen", ours), ("allreduce", allreduce or {})):
        if d:
            rows.append(f"    {label:10s} {_num(d.get('seconds'), '.1f'):>8s} s  "
                        f"{_num(d.get('steps'), '.0f'):>6s} steps  "
                        f"{_num(d.get('tokens'), ',d'):>12s} tokens")
    if ours.get("flags"):
        rows.append(f"  uncertain (a DiLoCo plan is charged {_margin()} more steps for it): "
                    + "; ".join(ours["flags"]))
    return rows


def _margin() -> str:
    return f"{OUT_OF_RANGE_MARGIN:.0%}"


def simulate_rows(predicted: dict[str, Any], step_s: float) -> list[str]:
    """`simulate`'s lines for a plan with a target: the predicted steps and tokens to it, and
    the time they take at the (mean, warm-up included) step `step_s` simulated now (the
    plan's own prediction beside)."""
    t = predicted.get("to_target")
    if not t:
        return []
    return [f"target: {t['target']}: predicted {t['steps']:.0f} steps, {t['tokens']:,} tokens; "
            f"at {step_s:.3f} s a step {t['steps'] * step_s:.1f} s"
            + (f" (the plan predicted {t['seconds']:.1f} s)" if t.get("seconds") else "")]


def measured_to_target(records: list[dict[str, Any]], loss: float) -> tuple[int, float] | None:
    """The first evaluation record at or below `loss`: (step, seconds of training to it, from
    the first record's wall clock less one step and minus evaluation time), None when none."""
    steps = [r for r in records if "step" in r and "wall_time" in r]
    if not steps:
        return None
    start = steps[0]["wall_time"] - steps[0].get("step_s", 0.0)
    evals = 0.0
    for r in steps:
        evals += r.get("eval_s", 0.0)
        if r.get("val_loss") is not None and r["val_loss"] <= loss:
            return int(r["step"]), r["wall_time"] - start - evals
    return None


def explain_rows(predicted: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """`explain`'s lines for a run whose plan has a target: predicted against measured steps
    and time to it, and which of the two (steps or step time) is the larger error."""
    t = predicted.get("to_target")
    if not t or t.get("loss") is None:
        return []
    got = measured_to_target(records, t["loss"])
    head = f"time to the target ({t['target']}, loss {t['loss']:.3f}):"
    if got is None:
        last = max((r["step"] for r in records if "step" in r), default=0)
        return [f"{head} not reached in {last} steps (predicted {t['steps']:.0f} steps, "
                f"{_num(t.get('seconds'), '.1f')} s)"]
    steps, seconds = got
    rows = [f"{head} measured {seconds:.1f} s at step {steps}, predicted "
            f"{_num(t.get('seconds'), '.1f')} s at step {t['steps']:.0f}"]
    if t.get("seconds"):
        step_err = (seconds / steps) / (t["seconds"] / t["steps"])
        steps_err = steps / t["steps"]
        larger = "steps" if abs(steps_err - 1) >= abs(step_err - 1) else "step time"
        rows.append(f"  steps {steps_err:.2f}x predicted, time per step {step_err:.2f}x: the "
                    f"larger error is the {larger}"
                    + (" (evaluated every few steps: the step is where it was seen)"
                       if larger == "steps" else ""))
    return rows
