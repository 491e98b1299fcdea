#!/usr/bin/env python3
"""gloo's fp32 all-reduce on the lab's links, measured beside the simulator's two models of it.

    sudo .venv/bin/python benchmarks/gloo_allreduce.py --out-dir out/gloo [--quick]

Brings up the demo's namespace lab (scenario `lab`, seed 0: 8 hosts in 4 regions, the
cluster's rates and delays), starts one process per host, and times
`torch.distributed.all_reduce` (gloo) of fp32 tensors of several sizes over: the two 4-member
groups of one device per region at once (the stage groups of the demo's 2 x 4 plans), all 8
devices, and the pair of devices farthest apart (a tied-embedding sum). The hosts share one
clock, so a run lasts from its group's last member's start to its last member's end (median
of --reps). Beside each, the simulator's predictions: gloo's model (SimConfig.
allreduce_algorithm "gloo", the cpu profile's: collectives.gloo_allreduce_s on gloo's rank-ordered
ring) and the ring model (2(n-1) steps of 2 latencies + B/n, on the ring order the planner
picks: what the cpu profile charged before). Writes OUT/results.json ({"rows": [...]}, each
with group, floats, measured_s, gloo_model_s, ring_model_s) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from formats.atomic_io import atomic_write_json  # noqa: E402
from formats.cluster import Cluster, save_cluster  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.models import get_model  # noqa: E402
from scheduler.scenarios import make_scenario  # noqa: E402
from scheduler.simulator import resolve_sim_config  # noqa: E402
from scheduler.simulator.collectives import (  # noqa: E402
    LinkTables,
    RingTable,
    gloo_allreduce_s,
    ring_allreduce_time,
    ring_step_s,
)
from testkit.lab import PY, log  # noqa: E402
from testkit.lab_network import Network, netns_unavailable  # noqa: E402

SIZES = (1_000, 32_768, 100_000, 429_568, 1_000_000, 4_000_000)
"""fp32 values per all-reduce (429,568: a gpt-tiny half, the demo's stage payload)."""
QUICK_SIZES = (1_000, 429_568, 4_000_000)
PORT = 29531


def case_groups(cluster: Cluster) -> list[tuple[str, list[list[int]]]]:
    """(name, groups that run at once): one device per region twice, everyone, the pair
    farthest apart."""
    by_region: dict[str, list[int]] = {}
    for d in cluster.devices:
        by_region.setdefault(d.region, []).append(d.id)
    halves = [sorted(ids[k] for ids in by_region.values() if len(ids) > k) for k in range(2)]
    lat = np.array(cluster.latency_ms)
    a, b = np.unravel_index(int(lat.argmax()), lat.shape)
    return [("one per region, 2 groups at once", halves),
            ("all devices", [sorted(d.id for d in cluster.devices)]),
            ("farthest pair", [sorted([int(a), int(b)])])]


def worker(rank: int, world: int, spec_path: Path, out: Path) -> None:
    """One host's process: every case's all-reduces, its (start, end) clock times to a file."""
    import torch
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{PORT}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    times: list[list[list[float]]] = []
    made: dict[str, list] = {}
    for k, (groups, numel) in enumerate(spec["cases"]):
        if rank == 0:  # progress, on the console (the other ranks' stdout is dropped)
            print(f"gloo:   case {k + 1}/{len(spec['cases'])}: {numel:,} values over "
                  f"{groups}", flush=True)
        key = json.dumps(groups)
        if key not in made:  # every rank makes every group, in the same order, once
            made[key] = [dist.new_group(g) for g in groups]
        mine = [pg for pg, g in zip(made[key], groups) if rank in g]
        tensor = torch.randn(numel)
        dist.barrier()
        for pg in mine:  # untimed: as in training, the groups have run before
            dist.all_reduce(tensor, group=pg)
        runs = []
        for _ in range(spec["reps"]):
            dist.barrier()
            start = time.time()
            for pg in mine:
                dist.all_reduce(tensor, group=pg)
            runs.append([start, time.time()])
        times.append(runs)
    dist.barrier()
    (out / f"worker{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def measure(net: Network, cases: list[tuple[list[list[int]], int]], reps: int, out: Path,
            world: int) -> list[list[list[list[float]]]]:
    """Run the workers in their hosts; per rank, per case, per rep: (start, end)."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "reps": reps}))
    netns = json.loads((net.dir / "rank_netns.json").read_text())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(["ip", "netns", "exec", netns[str(r)], PY, __file__, "--worker",
                               str(r), "--world", str(world), "--spec", str(spec),
                               "--out-dir", str(out)], env=env,
                              stdout=None if r == 0 else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    errors = [p.communicate()[1] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise UserError(f"rank {r} failed ({p.returncode}):\n{errors[r][-2000:]}")
    return [json.loads((out / f"worker{r}.json").read_text()) for r in range(world)]


def durations(times: list, group: list[int], case: int) -> float:
    """Median seconds from the group's last start to its last end over the reps."""
    runs = zip(*(times[r][case] for r in group))
    return float(np.median([max(e for _, e in rs) - max(s for s, _ in rs) for rs in runs]))


def ring_tables(cluster: Cluster) -> dict[str, RingTable]:
    """The cpu profile's rings of fp32 groups under each model ("gloo": gloo's rank order and
    one-way latencies; "ring": the planner's ring order, collective latency factor 2)."""
    tables = LinkTables(cluster, resolve_sim_config(runtime="cpu"))
    return {a: RingTable(tables, get_model("gpt-tiny"), "none",
                         resolve_sim_config(runtime="cpu", allreduce_algorithm=a))
            for a in ("gloo", "ring")}


def predictions(rings: dict[str, RingTable], group: list[int], numel: int
                ) -> tuple[float, float]:
    """(gloo model, ring model) seconds of an fp32 all-reduce of `numel` over `group`."""
    payload = numel * 4.0
    gloo, ring = (rings[a].ring(np.array(group), 1) for a in ("gloo", "ring"))
    step = ring_step_s(payload, len(group), gloo.sec_per_bit)
    return (float(gloo_allreduce_s(step, gloo.lat_s, payload)),
            ring_allreduce_time(ring.lat_s, 1.0 / ring.sec_per_bit, payload))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path("out/gloo_allreduce"))
    p.add_argument("--quick", action="store_true", help="3 sizes, 3 repetitions")
    p.add_argument("--sizes", type=int, nargs="+", help="fp32 values per all-reduce")
    p.add_argument("--reps", type=int, help="repetitions per size (median)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.world, args.spec, args.out_dir)
        return 0
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    if min(sizes) < 1 or reps < 1:
        raise UserError(f"--sizes {' '.join(map(str, sizes))} --reps {reps}: positive "
                        "integers only")
    if (reason := netns_unavailable()):
        raise UserError(f"needs the namespace lab (its links are what is measured): {reason}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cluster = make_scenario("lab", 0)
    cluster_path = args.out_dir / "cluster.json"
    save_cluster(cluster, cluster_path)
    named = case_groups(cluster)
    cases = [(groups, n) for _, groups in named for n in sizes]
    net = Network(cluster_path, args.out_dir, use_netns=True)
    try:
        net.up()
        log(f"timing {len(cases)} cases x {reps} repetitions on {cluster.num_devices} hosts",
            "gloo")
        times = measure(net, cases, reps, args.out_dir, cluster.num_devices)
    finally:
        net.down()
    rows, rings = [], ring_tables(cluster)
    for k, (groups, numel) in enumerate(cases):
        name = next(n for n, g in named if g == groups)
        for group in groups:
            gloo_s, ring_s = predictions(rings, group, numel)
            rows.append({"case": name, "group": group, "floats": numel,
                         "measured_s": durations(times, group, k), "gloo_model_s": gloo_s,
                         "ring_model_s": ring_s})
    print_table(rows)
    atomic_write_json(args.out_dir / "results.json", {"rows": rows})
    log(f"wrote {args.out_dir / 'results.json'}", "gloo")
    return 0


def print_table(rows: list[dict]) -> None:
    """The rows with each model's prediction over the measurement."""
    print("\n| group | fp32 values | measured s | gloo model s (ratio) | ring model s (ratio) |")
    print("|---|---|---|---|---|")
    for r in rows:
        m = r["measured_s"]
        print(f"| {r['group']} | {r['floats']:,} | {m:.3f} | {r['gloo_model_s']:.3f} "
              f"({r['gloo_model_s'] / m:.2f}x) | {r['ring_model_s']:.3f} "
              f"({r['ring_model_s'] / m:.2f}x) |")


if __name__ == "__main__":
    run_main(main)
