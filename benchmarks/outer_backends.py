"""The same DiLoCo run with the store backend and with --outer-backend hivemind, on loopback.

    python benchmarks/outer_backends.py --out-dir D [--quick]

4 replicas x 1 stage of gpt-tiny on real text (the default corpus), H = 10, int8 outer
payload, one CPU thread per rank; the store row runs the 4 ranks on one rendezvous store, the
hivemind row runs each replica with its own store and --outer-backend hivemind (the first
replica's DHT address as --initial-peers). Per row: seconds per outer sync (mean and max of
the steps that synced: their comm_s), bytes per replica per round, final loss (mean over
replicas of the last step's), loss ratio vs the store row, max parameter difference between
replicas after the last round (from the final checkpoints). Writes OUT/results.json
({"rows": [...]}, as issue 23 names the fields) and prints the table. Only the loopback rows:
the shaped, NAT and fault rows of issue 23 are not done (docs/hivemind.md, "Not done").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from formats.atomic_io import atomic_write_json  # noqa: E402
from testkit.fault_harness import ROOT, free_port, write_trial_plan  # noqa: E402
from testkit.hivemind_runs import HivemindRun, load_models, max_param_diff  # noqa: E402

REPLICAS = 4


def make_plan(out: Path, inner_steps: int) -> Path:
    """4 x 1 gpt-tiny DiLoCo plan with the int8 outer payload."""
    plan = write_trial_plan(out / "plan.json", REPLICAS, 1, "diloco", inner_steps=inner_steps)
    data = json.loads(plan.read_text())
    data["sync"]["compression"] = "int8"
    plan.write_text(json.dumps(data, indent=1))
    return plan


def run_store(plan: Path, out: Path, steps: int) -> None:
    """The 4 ranks on one store (rank 0 hosts it)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for r in range(REPLICAS):
        cmd = [sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(plan), "--rank",
               str(r), "--dist-url", url, "--threads", "1", "--steps", str(steps),
               "--metrics", str(out / "m.jsonl"), "--ckpt-dir", str(out / "ck")]
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise RuntimeError(f"store run failed: {codes}; logs in {out}")


def run_hivemind(plan: Path, out: Path, steps: int) -> None:
    """Each replica on its own store, the outer average through hivemind."""
    run = HivemindRun(plan, out)
    args = ("--steps", str(steps), "--metrics", str(out / "m.jsonl"), "--ckpt-dir",
            str(out / "ck"))
    try:
        run.start(0, *args)
        peers = run.peers_of(0)
        for r in range(1, REPLICAS):
            run.start(r, *args, peers=peers)
        codes = run.wait(900)
        if any(codes.values()):
            raise RuntimeError(f"hivemind run failed: {codes}; logs in {out}")
    finally:
        run.stop()


def summarize(name: str, backend: str, out: Path, steps: int) -> dict:
    """One row of results.json from the run's metrics and final checkpoints."""
    syncs, sent, last = [], [], []
    for r in range(REPLICAS):
        path = out / ("m.jsonl" if r == 0 else f"m.r{r}.jsonl")
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prev = 0
        for rec in recs:
            if rec["outer_step"] != prev:
                syncs.append(rec["comm_s"])
                sent.append(rec["dp_bytes_sent"])
                prev = rec["outer_step"]
        last.append(recs[-1]["loss"])
    diff = max_param_diff(load_models(out / "ck", list(range(REPLICAS)), steps))
    return {"name": name, "backend": backend, "net": "loopback",
            "s_per_outer_sync": {"mean": round(statistics.mean(syncs), 4),
                                 "max": round(max(syncs), 4)},
            "bytes_per_round": int(statistics.mean(sent)),
            "final_loss": round(statistics.mean(last), 4), "max_param_diff": diff}


def main(argv: list[str] | None = None) -> int:
    """Run both rows, write OUT/results.json, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--quick", action="store_true", help="40 steps instead of 200")
    args = p.parse_args(argv)
    steps = 40 if args.quick else 200
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args.out_dir, inner_steps=10)
    rows = []
    for name, backend, runner in (("store_loopback", "store", run_store),
                                  ("hivemind_loopback", "hivemind", run_hivemind)):
        out = args.out_dir / name
        out.mkdir(exist_ok=True)
        t0 = time.monotonic()
        runner(plan, out, steps)
        row = summarize(name, backend, out, steps)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    for row in rows:
        row["loss_ratio_vs_store"] = round(row["final_loss"] / rows[0]["final_loss"], 4)
    atomic_write_json(args.out_dir / "results.json", {"rows": rows})
    print(f"{'row':<20}{'s/sync mean':>12}{'max':>8}{'bytes/round':>13}{'loss':>8}"
          f"{'ratio':>8}{'param diff':>12}")
    for r in rows:
        s = r["s_per_outer_sync"]
        print(f"{r['name']:<20}{s['mean']:>12.3f}{s['max']:>8.3f}{r['bytes_per_round']:>13}"
              f"{r['final_loss']:>8.4f}{r['loss_ratio_vs_store']:>8.4f}{r['max_param_diff']:>12g}")
    hv, st = rows[1]["s_per_outer_sync"]["mean"], rows[0]["s_per_outer_sync"]["mean"]
    print(f"hivemind / store seconds per outer sync: {hv / max(st, 1e-9):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
