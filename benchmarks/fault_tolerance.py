"""Fault tolerance of dist_runner.py: kill -9 trials, detection time, rejoin time, and the
training thread's blocking time of an asynchronous checkpoint against a synchronous one.

    python benchmarks/fault_tolerance.py [--trials 20] [--allreduce-trials 4] [--rank0-trials 5]
        [--model gpt-small] [--rows diloco,allreduce,rank0,rejoin,checkpoint]

Trials: DiLoCo 1 stage x 3 replicas (gpt-tiny, fake data, --heartbeat-timeout-s 2); a random
rank other than 0 (rank 0 hosts the store) is SIGKILLed at a random step; a survival is a trial
where every other rank finished with status 0 and no process was left. Detection time: kill ->
the first survivor log line naming the lost rank. Allreduce trials (1 x 2): the survivor must
exit 1 naming the lost rank; exit time reported. Rank 0 trials (1x3 DiLoCo behind a coordinator
process, scripts/coordinator.py): rank 0 is SIGKILLed at a random step; a survival is a trial
where ranks 1 and 2 finished with status 0, the coordinator exited 0 and no process was left.
Rejoin: a third replica started with --join
mid-run; the time from its join request to its first outer step with the others (includes
waiting for the next outer step) and the point-to-point transfer of the outer state.
Checkpoint blocking: in one process, the same model + AdamW state saved N times by the
background writer (blocking = snapshot) and synchronously (serialise + write + fsync + rename).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from formats.models import get_model  # noqa: E402
from modules.config import RunConfig  # noqa: E402
from modules.model.decoder import StageModel  # noqa: E402
from modules.train.checkpoint import AsyncCheckpointer, save_checkpoint, snapshot, step_path  # noqa: E402
from modules.train.trainer import make_inner_optimizer  # noqa: E402
from testkit.fault_harness import (  # noqa: E402
    Ranks,
    free_port,
    kill_trial,
    poll_exits,
    write_trial_plan,
)


def checkpoint_blocking(model_name: str, reps: int, tmp: Path) -> tuple[float, float, int]:
    """(async median s, sync median s, bytes): blocking time of one checkpoint each way."""
    spec = get_model(model_name)
    model = StageModel(spec, 0, spec.num_layers, seed=0)
    opt = make_inner_optimizer(model, RunConfig(steps=1))
    w = torch.randint(0, spec.vocab_size, (1, spec.seq_len + 1))
    model(w[:, :-1], w[:, 1:]).backward()
    opt.step()  # AdamW state exists
    state = lambda step: {"step": step, "model": model.state_dict(), "opt": opt.state_dict()}
    ck = AsyncCheckpointer(tmp / "async", 0, keep=2)
    async_s, sync_s = [], []
    for i in range(reps):  # alternate, so both see the same machine state
        ck.flush()  # a real run has H steps between checkpoints: the write is done
        async_s.append(ck.save(i, {}, state(i)))
        ck.flush()
        t0 = time.perf_counter()
        save_checkpoint(step_path(tmp / "sync", 0, i), {}, snapshot(state(i)))
        sync_s.append(time.perf_counter() - t0)
    size = step_path(tmp / "sync", 0, reps - 1).stat().st_size
    return statistics.median(async_s), statistics.median(sync_s), size


def rejoin(tmp: Path) -> tuple[float | None, float | None, bool]:
    """(join request -> first outer step s, outer-state transfer s, all exited 0)."""
    plan = write_trial_plan(tmp / "plan.json", 3, 1, "diloco", inner_steps=4)
    ranks = Ranks(plan, f"tcp://127.0.0.1:{free_port()}", tmp)
    common = ("--fake-data", "--steps", "400", "--timeout-s", "60", "--log-every", "10")
    try:
        for r in (0, 1):
            ranks.start(r, "--replicas", "0,1", *common)
        ranks.wait_for_text(0, "step 40/400", 120)
        ranks.start(2, "--join", *common)
        poll_exits(ranks, 240)
    finally:
        ranks.stop()
    ok = all(p.returncode == 0 for p in ranks.procs.values())
    m = re.search(r"joined at step \d+ \(outer step \d+\) after ([\d.]+) s", ranks.output(2))
    s = re.search(r"sent the outer state of stage 0 to joining rank 2 in ([\d.]+) s",
                  ranks.output(0))
    return (float(m.group(1)) if m else None), (float(s.group(1)) if s else None), ok


def rank0_trials(tmp: Path, trials: int, rng: random.Random) -> tuple[int, list[float], int]:
    """(survivals, detection times, orphans) of SIGKILLing rank 0 of a 1x3 DiLoCo run behind a
    coordinator process."""
    survived, detect, orphans = 0, [], 0
    for t in range(trials):
        step = rng.randrange(2, 40)
        res = kill_trial(tmp / f"c{t}", "diloco", 3, 1, 0, step, steps=160, heartbeat_s=2.0,
                         coordinator=True)
        ok = (not res.orphans and res.codes[1] == res.codes[2] == 0
              and res.coordinator_code == 0)
        survived += ok
        orphans += len(res.orphans)
        if res.detect_s is not None:
            detect.append(res.detect_s)
        print(f"rank 0 trial {t + 1}: killed rank 0 at step {step}: "
              f"{'survived' if ok else 'FAILED'}, detected after "
              f"{res.detect_s if res.detect_s is None else round(res.detect_s, 2)} s",
              flush=True)
    return survived, detect, orphans


ROWS = ("diloco", "allreduce", "rank0", "rejoin", "checkpoint")


def parse_rows(text: str) -> tuple[str, ...]:
    """--rows: comma-separated names out of ROWS."""
    rows = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ROWS)}, got {text!r}")
    return rows


def main() -> None:
    """Run everything (or --rows) and print one markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--allreduce-trials", type=int, default=4)
    p.add_argument("--rank0-trials", type=int, default=5)
    p.add_argument("--model", default="gpt-small", help="model of the checkpoint measurement")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=parse_rows, default=ROWS,
                   help=f"which measurements to run, comma-separated (default {','.join(ROWS)})")
    args = p.parse_args()
    rows = args.rows
    if "diloco" not in rows:
        args.trials = 0
    if "allreduce" not in rows:
        args.allreduce_trials = 0
    if "rank0" not in rows:
        args.rank0_trials = 0
    rng = random.Random(args.seed)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        survived, detect, orphans = 0, [], 0
        for t in range(args.trials):
            victim, step = rng.randrange(1, 3), rng.randrange(2, 40)
            res = kill_trial(tmp / f"d{t}", "diloco", 3, 1, victim, step, steps=160,
                             heartbeat_s=2.0)
            ok = (not res.orphans and all(c == 0 for r, c in res.codes.items() if r != victim))
            survived += ok
            orphans += len(res.orphans)
            if res.detect_s is not None:
                detect.append(res.detect_s)
            print(f"trial {t + 1}: killed rank {victim} at step {step}: "
                  f"{'survived' if ok else 'FAILED'}, detected after "
                  f"{res.detect_s if res.detect_s is None else round(res.detect_s, 2)} s",
                  flush=True)
        ar_ok, ar_exit = 0, []
        for t in range(args.allreduce_trials):
            victim, step = 1, rng.randrange(2, 40)
            res = kill_trial(tmp / f"a{t}", "allreduce", 2, 1, victim, step, steps=400,
                             heartbeat_s=2.0)
            good = res.codes[0] == 1 and "is gone" in res.outputs[0] and not res.orphans
            ar_ok += good
            orphans += len(res.orphans)
            if 0 in res.exit_s:
                ar_exit.append(res.exit_s[0])
            print(f"allreduce trial {t + 1}: {'clean exit' if good else 'FAILED'} after "
                  f"{res.exit_s.get(0)} s", flush=True)
        r0_ok, r0_detect, r0_orphans = rank0_trials(tmp / "rank0", args.rank0_trials, rng)
        orphans += r0_orphans
        if "rejoin" in rows:
            join_s, xfer_s, join_ok = rejoin(tmp / "join")
        if "checkpoint" in rows:
            a_s, s_s, size = checkpoint_blocking(args.model, args.reps, tmp / "ck")

    fmt = lambda v: "n/a" if v is None else f"{v:.2f} s"
    spread = lambda v: f"{statistics.median(v):.2f} s / {max(v):.2f} s"
    print()
    print("| measurement | value |")
    print("|---|---|")
    if "diloco" in rows:
        print(f"| DiLoCo kill -9 trials (1x3, heartbeat timeout 2 s) | {args.trials} |")
        print(f"| survivals (other replicas finished, exit 0) | {survived}/{args.trials} |")
        if detect:
            print(f"| detection time median / max | {spread(detect)} |")
    if "allreduce" in rows:
        print(f"| allreduce trials: clean exit 1 naming the lost rank | {ar_ok}/"
              f"{args.allreduce_trials} |")
        if ar_exit:
            print(f"| allreduce survivor exit after kill, median / max | {spread(ar_exit)} |")
    if "rank0" in rows:
        print(f"| DiLoCo kill -9 of rank 0 behind a coordinator (1x3, heartbeat timeout 2 s) | "
              f"{args.rank0_trials} |")
        print(f"| survivals (replicas 1, 2 finished, coordinator exit 0) | {r0_ok}/"
              f"{args.rank0_trials} |")
        if r0_detect:
            print(f"| rank 0 detection time median / max | {spread(r0_detect)} |")
    print(f"| orphan processes | {orphans} |")
    if "rejoin" in rows:
        print(f"| rejoin: join request -> first outer step (incl. waiting for it) | "
              f"{fmt(join_s)}{'' if join_ok else ' (run failed)'} |")
        print(f"| rejoin: outer state transfer (gpt-tiny) | {fmt(xfer_s)} |")
    if "checkpoint" in rows:
        print(f"| checkpoint blocking, async (snapshot), {args.model} {size / 1e6:.0f} MB | "
              f"{a_s * 1e3:.1f} ms |")
        print(f"| checkpoint blocking, synchronous | {s_s * 1e3:.1f} ms |")
        print(f"| ratio synchronous / async | {s_s / a_s:.1f}x |")


if __name__ == "__main__":
    main()
