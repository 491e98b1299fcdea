"""The same DiLoCo run with the store backend and with --outer-backend hivemind: on loopback,
on namespace hosts shaped like the lab, and with a replica killed and replaced.

    python benchmarks/outer_backends.py --out-dir D [--quick]
        [--rows loopback,shaped,overlap,fault,nat]

4 replicas x 1 stage of gpt-tiny on real text (the default corpus), H = 10, int8 outer
payload, one CPU thread per rank; the store rows run the 4 ranks on one rendezvous store
(rank 0's), the hivemind rows run each replica with its own store and --outer-backend hivemind
(the first replica's DHT address as --initial-peers). Rows (--rows, default all):

  loopback  every replica on this host's loopback;
  shaped    each replica in a namespace host of its own (scripts/local_cluster.py), 50 Mbit/s
            between any two (tc; no added delay: this kernel has no netem, and the delay line's
            Python process per host would take the CPU the 2-core machine trains on), the
            cluster file passed as --cluster (the hivemind deadlines come from it; needs root);
  overlap   the shaped rows with sync.overlap on (the outer sync hides behind the next round's
            compute);
  fault     loopback, 30 rounds: kill -9 of replica 3 in the middle of round 2's inner steps, a
            new replica 3 started with --join when the survivors finished round 4;
  nat       hivemind only, on the NAT lab of the hole-punching tests
            (udp_hole_punching_test/netns_lab.py: two LANs behind MASQUERADE NATs that drop
            unsolicited packets, a public side): a bare DHT node (scripts/dht_node.py) and
            replicas 0 and 1 on the public side, replicas 2 and 3 each behind a NAT with
            --client-mode (needs root and iptables). The store cannot run there (gloo connects
            every pair of ranks both ways), so its loss ratio is against the store's loopback
            row when that ran in the same invocation (same plan and steps: expect 1.0000).

Per row: seconds per outer sync (mean and max of the steps that synced: their comm_s; and the
mean after round 1, whose wait includes the start barrier), bytes
per replica per round, tokens/s (the run's tokens over the time of the steps after round 1,
outer waits included, as each replica measured it; mean over replicas), final loss
(mean over replicas of the last step's), loss ratio vs the store row of the same net, max
parameter difference between replicas after the last round (from the final checkpoints). Fault
rows add `survived` (every survivor and the joiner exited 0), `stall_s` (the survivors' longest
step after the kill minus their median step) and `joiner_caught_up` (the joiner's final
parameters equal the survivors'). A row that cannot run says why (`skipped`). Writes
OUT/results.json ({"rows": [...]}, the fields issue 23 names) and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from formats.atomic_io import atomic_write_json  # noqa: E402
from testkit.fault_harness import ROOT, write_trial_plan  # noqa: E402
from testkit.hivemind_runs import PEERS, HivemindRun, load_models, max_param_diff  # noqa: E402

REPLICAS = 4
H = 10
SHAPED_GBPS = 0.05
"""50 Mbit/s between any two replicas, as between the lab's replicas."""
ROWS = ("loopback", "shaped", "overlap", "fault", "nat")
NAT_CLIENTS = {2: "a", 3: "b"}
"""Replicas behind a NAT (-> the lab's side); the others sit on the public side."""
FAULT_STEPS = 30 * H
"""Long enough that a joiner started after round 4 finds the survivors still training with
rounds to go (its start took up to 13 rounds, ~60 s, with the load average at 25)."""
KILLED = 3


def bytes_per_round(recs: list[dict], rounds: int) -> float:
    """One replica's data-parallel bytes over its rounds: every step's, since an overlapped
    round's bytes are counted in pieces on the steps its background all-reduce spans (the
    store's overlap row showed a third to a half of its payload when only the round's boundary
    step was read)."""
    return sum(r["dp_bytes_sent"] for r in recs) / max(1, rounds)


def throughput(recs: list[dict]) -> float:
    """The run's tokens per second over these steps of one replica: every step's tokens (its
    tokens/s x step_s: all live replicas', either backend) over their summed time. Not the mean
    of the steps' rates, which favoured the backend whose step times vary most."""
    return sum(r["tokens_per_s"] * r["step_s"] for r in recs) / sum(r["step_s"] for r in recs)


def make_plan(out: Path, overlap: bool = False) -> Path:
    """4 x 1 gpt-tiny DiLoCo plan with the int8 outer payload (and sync.overlap)."""
    path = out / ("plan_overlap.json" if overlap else "plan.json")
    plan = write_trial_plan(path, REPLICAS, 1, "diloco", inner_steps=H)
    data = json.loads(plan.read_text())
    data["sync"]["compression"] = "int8"
    data["sync"]["overlap"] = overlap
    plan.write_text(json.dumps(data, indent=1))
    return plan


@contextlib.contextmanager
def shaped_hosts(out: Path) -> Iterator[dict]:
    """One namespace host per replica, 50 Mbit/s between any two; yields {"netns", "addrs",
    "cluster"} for HivemindRun, removes the hosts on the way out."""
    import numpy as np

    from formats.cluster import Cluster, Device, save_cluster

    lat = np.zeros((REPLICAS, REPLICAS))
    bw = np.full((REPLICAS, REPLICAS), SHAPED_GBPS)
    np.fill_diagonal(bw, np.inf)
    devices = [Device(i, f"replica{i}", f"r{i}", f"10.9.0.{i + 1}", "T4-16GB", 65.0, 16.0)
               for i in range(REPLICAS)]
    cpath = out / "cluster_shaped.json"
    save_cluster(Cluster("shaped-50mbit", devices, lat, bw), cpath)
    prefix, net_dir = f"ob{os.getpid() % 100000}", out / "net"
    py = sys.executable
    up = subprocess.run([py, str(ROOT / "scripts/local_cluster.py"), "up", "--cluster", str(cpath),
                         "--prefix", prefix, "--out-dir", str(net_dir), "--link-gbps", "10"],
                        capture_output=True, text=True)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"local_cluster.py up failed: {up.stderr.strip()[-500:]}")
        hosts = json.loads((net_dir / "netns_map.json").read_text())["hosts"]
        yield {"netns": {h["index"]: h["netns"] for h in hosts},
               "addrs": {h["index"]: h["address"] for h in hosts},
               "cluster": net_dir / "cluster.json"}
    finally:
        subprocess.run([py, str(ROOT / "scripts/local_cluster.py"), "down", "--prefix", prefix],
                       capture_output=True, text=True)


@contextlib.contextmanager
def nat_hosts(out: Path, clients: dict[int, str], replicas: int = REPLICAS) -> Iterator[dict]:
    """The two-NAT lab with a bare DHT node on its public side; yields HivemindRun's hosts
    ({"netns", "addrs", "clients", "peers": the node's address}); removes it all after."""
    from udp_hole_punching_test.netns_lab import CLIENT_IPS, SERVER_IP, Lab

    lab = Lab(f"ob{os.getpid() % 100000}n")
    node = None
    try:
        lab.up()
        log = out / "dht_node.log"
        with open(log, "w") as f:
            node = subprocess.Popen([*lab.exec_prefix("pub"), sys.executable,
                                     str(ROOT / "scripts/dht_node.py"), "--host-maddrs",
                                     f"/ip4/{SERVER_IP}/tcp/0"], stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        peers = node_address(log, node)
        netns = {r: lab.ns(f"cli{clients[r]}" if r in clients else "pub") for r in range(replicas)}
        addrs = {r: CLIENT_IPS[clients[r]] if r in clients else SERVER_IP
                 for r in range(replicas)}
        yield {"netns": netns, "addrs": addrs, "clients": set(clients), "peers": peers}
    finally:
        if node is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
        lab.close()


def node_address(log: Path, node: subprocess.Popen, timeout: float = 90) -> str:
    """The --initial-peers address the DHT node printed (RuntimeError with its log if none)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.poll() is None:
        found = PEERS.search(log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"the DHT node printed no address:\n{log.read_text()[-2000:]}")


def run_nat(plan: Path, out: Path, steps: int, hosts: dict, replicas: int = REPLICAS) -> None:
    """Train the NAT row: the public replicas first (each through the node and the public
    replicas before it), then the clients (through the node and every public replica)."""
    run = HivemindRun(plan, out, netns=hosts["netns"], addrs=hosts["addrs"], ifname="lo")
    args = common_args(out, steps, None)
    peers = [hosts["peers"]]
    try:
        for r in range(replicas):
            if r in hosts["clients"]:
                run.start(r, *args, "--client-mode", peers=",".join(peers))
            else:
                run.start(r, *args, peers=",".join(peers))
                peers.append(run.peers_of(r))
        codes = wait_or_fail(run, 900)
        if any(codes.values()):
            raise RuntimeError(f"hivemind NAT run failed: {codes}; logs in {out}")
        left = run.p2pd_left()
        if left:
            raise RuntimeError(f"p2pd processes {left} outlived the NAT run")
    finally:
        run.stop()


def wait_or_fail(run: HivemindRun, timeout: float) -> dict[int, int | None]:
    """Exit status of every rank, returning as soon as one failed (the others would only wait
    `--timeout-s` for it); None: still running at `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = {r: p.poll() for r, p in run.procs.items()}
        if any(codes.values()) or all(c is not None for c in codes.values()):
            return codes
        time.sleep(0.5)
    return {r: p.poll() for r, p in run.procs.items()}


def new_run(backend: str, plan: Path, out: Path, hosts: dict | None) -> HivemindRun:
    """The processes of one row (in `hosts`' namespaces when given)."""
    hosts = hosts or {}
    return HivemindRun(plan, out, backend=backend, netns=hosts.get("netns", {}),
                       addrs=hosts.get("addrs", {}))


def start_all(run: HivemindRun, args: tuple[str, ...], replicas: range) -> str | None:
    """Start `replicas` (hivemind: each through the addresses of all started before it, so
    that every pair has a direct connection from the start); the --initial-peers to pass to
    a later replica (None with the store)."""
    peers: list[str] = []
    for r in replicas:
        run.start(r, *args, peers=",".join(peers) or None)
        if run.backend == "hivemind":
            peers.append(run.peers_of(r))
    return ",".join(peers) or None


def common_args(out: Path, steps: int, hosts: dict | None) -> tuple[str, ...]:
    """dist_runner.py flags every rank of a row gets."""
    args = ("--steps", str(steps), "--metrics", str(out / "m.jsonl"), "--ckpt-dir",
            str(out / "ck"), "--heartbeat-timeout-s", "5", "--timeout-s", "120")
    return args + (("--cluster", str(hosts["cluster"])) if hosts else ())


def run_row(backend: str, plan: Path, out: Path, steps: int, hosts: dict | None) -> None:
    """Train the row to the end (RuntimeError naming the logs if a rank failed)."""
    run = new_run(backend, plan, out, hosts)
    try:
        start_all(run, common_args(out, steps, hosts), range(REPLICAS))
        codes = run.wait(900)
        if any(codes.values()):
            raise RuntimeError(f"{backend} run failed: {codes}; logs in {out}")
    finally:
        run.stop()


def run_fault(backend: str, plan: Path, out: Path) -> dict:
    """kill -9 of replica KILLED mid-round 2, a --join replacement after round 4: survived,
    stall_s, joiner_caught_up (and kill_time for the stall)."""
    run = new_run(backend, plan, out, None)
    args = common_args(out, FAULT_STEPS, None)
    try:
        peers = start_all(run, args, range(REPLICAS))
        # rank 0 logs every step with either backend (the replicas step in lockstep)
        if not run.wait_for(0, rf"step {H + H // 2}/", 300):
            raise RuntimeError(f"replica 0 never reached step {H + H // 2}; logs in {out}")
        run.kill(KILLED)
        killed_at = time.time()
        run.procs[KILLED].wait(30)
        os.replace(out / f"rank{KILLED}.log", out / f"rank{KILLED}.killed.log")
        if not run.wait_for(0, r"outer_step 4:", 300):
            raise RuntimeError(f"the survivors never finished round 4; logs in {out}")
        join_args = [a if a != str(out / "m.jsonl") else str(out / "join.jsonl") for a in args]
        if backend == "hivemind":
            run.start(KILLED, *join_args, "--join", peers=peers)
        else:
            run.start(KILLED, *join_args, "--join")
        codes = run.wait(600)
    finally:
        run.stop()
    models = load_models(out / "ck", list(range(REPLICAS)), FAULT_STEPS) if codes[KILLED] == 0 \
        else []
    return {"survived": not any(codes.values()), "codes": codes,
            "stall_s": stall(out, killed_at),
            "joiner_caught_up": bool(models) and max_param_diff(models) == 0.0}


def stall(out: Path, killed_at: float) -> float:
    """The survivors' longest step after the kill minus their median step (s)."""
    after, every = [], []
    for r in range(REPLICAS):
        if r == KILLED:
            continue
        for rec in records(out / ("m.jsonl" if r == 0 else f"m.r{r}.jsonl")):
            every.append(rec["step_s"])
            if rec["wall_time"] > killed_at:
                after.append(rec["step_s"])
    return round(max(after, default=0.0) - statistics.median(every), 3)


def records(path: Path) -> list[dict]:
    """The step records of a metrics file."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if "step_s" in r]


def summarize(name: str, backend: str, net: str, out: Path, steps: int,
              replicas: list[int]) -> dict:
    """One row of results.json from the run's metrics and final checkpoints."""
    syncs, later, sent, last, tps = [], [], [], [], []
    for r in replicas:
        recs = records(out / ("m.jsonl" if r == 0 else f"m.r{r}.jsonl"))
        prev, rounds = 0, 0
        for rec in recs:
            if rec["outer_step"] != prev:
                syncs.append(rec["comm_s"])
                if prev:  # round 1 includes the start barrier (waiting for the last to start)
                    later.append(rec["comm_s"])
                prev, rounds = rec["outer_step"], rounds + 1
        sent.append(bytes_per_round(recs, rounds))
        last.append(recs[-1]["loss"])
        tps.append(throughput(recs[H:] or recs))
    diff = max_param_diff(load_models(out / "ck", replicas, steps))
    return {"name": name, "backend": backend, "net": net,
            "s_per_outer_sync": {"mean": round(statistics.mean(syncs), 4),
                                 "max": round(max(syncs), 4),
                                 "mean_after_round1": round(statistics.mean(later or syncs), 4)},
            "bytes_per_round": int(statistics.mean(sent)),
            "tokens_per_s": round(statistics.mean(tps), 1),
            "final_loss": round(statistics.mean(last), 4), "max_param_diff": diff}


def one_row(args: argparse.Namespace, kind: str, backend: str, hosts: dict | None) -> dict:
    """Run and summarize one row; a row that failed is {"name", "skipped": why}."""
    name = f"{backend}_{kind}"
    out = args.out_dir / name
    out.mkdir(exist_ok=True)
    net = {"loopback": "loopback", "fault": "loopback", "nat": "nat"}.get(kind, "shaped")
    plan = make_plan(args.out_dir, overlap=kind == "overlap")
    refused = refusal(backend, plan)
    if refused:
        print(f"{name}: refused: {refused}", flush=True)
        return {"name": name, "backend": backend, "net": net, "skipped": refused}
    t0 = time.monotonic()
    try:
        if kind == "nat":
            run_nat(plan, out, args.steps, hosts)
            row = summarize(name, backend, net, out, args.steps, list(range(REPLICAS)))
            row["behind_nat"] = sorted(hosts["clients"])
        elif kind == "fault":
            fault = run_fault(backend, plan, out)
            row = summarize(name, backend, net, out, FAULT_STEPS,
                            [r for r in range(REPLICAS) if r != KILLED])
            row.update(fault)
        else:
            run_row(backend, plan, out, args.steps, hosts)
            row = summarize(name, backend, net, out, args.steps, list(range(REPLICAS)))
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        print(f"{name}: FAILED: {e}", flush=True)
        return {"name": name, "backend": backend, "net": net, "skipped": str(e)}
    row["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"{name}: done in {row['wall_s']} s", flush=True)
    return row


def refusal(backend: str, plan: Path) -> str:
    """Why dist_runner.py refuses the plan with `backend` ('' when it runs it)."""
    from formats.errors import UserError
    from formats.plan import load_plan
    from modules.config import HivemindConfig

    try:
        HivemindConfig(outer_backend=backend).check_plan(load_plan(plan))
    except UserError as e:
        return str(e)
    return ""


def all_rows(args: argparse.Namespace) -> list[dict]:
    """Every requested row, store before hivemind for each kind."""
    rows = []
    for kind in ("loopback", "fault"):
        if kind in args.rows:
            rows += [one_row(args, kind, b, None) for b in ("store", "hivemind")]
    shaped = [k for k in ("shaped", "overlap") if k in args.rows]
    if shaped:
        why = "" if os.geteuid() == 0 else "namespace hosts need root"
        if why:
            rows += [{"name": f"{b}_{k}", "backend": b, "net": "shaped", "skipped": why}
                     for k in shaped for b in ("store", "hivemind")]
        else:
            with shaped_hosts(args.out_dir) as hosts:
                rows += [one_row(args, k, b, hosts) for k in shaped for b in ("store", "hivemind")]
    if "nat" in args.rows:
        rows.append(nat_row(args))
    ratios(rows)
    return rows


def nat_row(args: argparse.Namespace) -> dict:
    """The hivemind row on the NAT lab (or why it cannot run here)."""
    from udp_hole_punching_test.netns_lab import missing_requirements

    why = missing_requirements()
    if why:
        return {"name": "hivemind_nat", "backend": "hivemind", "net": "nat", "skipped": why}
    try:
        with nat_hosts(args.out_dir, NAT_CLIENTS) as hosts:
            return one_row(args, "nat", "hivemind", hosts)
    except (RuntimeError, OSError) as e:
        print(f"hivemind_nat: FAILED: {e}", flush=True)
        return {"name": "hivemind_nat", "backend": "hivemind", "net": "nat", "skipped": str(e)}


def ratios(rows: list[dict]) -> None:
    """loss_ratio_vs_store (and for hivemind, sync_s_vs_store and tokens_per_s_vs_store)
    against the store row of the same kind."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        st = by_name.get("store_loopback" if r.get("net") == "nat"  # no store row behind NATs
                         else r["name"].replace(r["backend"], "store", 1))
        if "skipped" in r or st is None or "skipped" in st:
            continue
        r["loss_ratio_vs_store"] = round(r["final_loss"] / st["final_loss"], 4)
        if r["backend"] != "store":
            for key, field in (("sync_s_vs_store", "mean"),
                               ("sync_s_vs_store_after_round1", "mean_after_round1")):
                r[key] = round(r["s_per_outer_sync"][field]
                               / max(st["s_per_outer_sync"][field], 1e-9), 2)
            r["tokens_per_s_vs_store"] = round(r["tokens_per_s"] / st["tokens_per_s"], 3)


def print_table(rows: list[dict]) -> None:
    """The rows as a table (fault fields after)."""
    print(f"{'row':<20}{'s/sync mean':>12}{'max':>8}{'bytes/round':>13}{'tok/s':>8}{'loss':>8}"
          f"{'ratio':>8}{'param diff':>12}  fault")
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:<20} skipped: {r['skipped']}")
            continue
        s = r["s_per_outer_sync"]
        fault = (f"  survived {r['survived']}, stall {r['stall_s']} s, joiner caught up "
                 f"{r['joiner_caught_up']}" if "survived" in r else "")
        print(f"{r['name']:<20}{s['mean']:>12.3f}{s['max']:>8.3f}{r['bytes_per_round']:>13}"
              f"{r['tokens_per_s']:>8.0f}{r['final_loss']:>8.4f}"
              f"{r.get('loss_ratio_vs_store', float('nan')):>8.4f}{r['max_param_diff']:>12g}"
              f"{fault}")
    for r in rows:
        if "sync_s_vs_store" in r:
            print(f"{r['name']}: hivemind / store seconds per outer sync "
                  f"{r['sync_s_vs_store']:.2f}x ({r['sync_s_vs_store_after_round1']:.2f}x after "
                  f"round 1), tokens/s {r['tokens_per_s_vs_store']:.3f}x")


def rows_arg(text: str) -> tuple[str, ...]:
    """--rows: some of ROWS, comma-separated."""
    got = tuple(t for t in text.split(",") if t)
    bad = [t for t in got if t not in ROWS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ROWS)}, got {text!r}")
    return got


def main(argv: list[str] | None = None) -> int:
    """Run the rows, write OUT/results.json, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--quick", action="store_true",
                   help="40 steps instead of 200 (the fault rows: 300 either way)")
    p.add_argument("--rows", type=rows_arg, default=ROWS,
                   help=f"which rows, comma-separated (default {','.join(ROWS)})")
    args = p.parse_args(argv)
    args.steps = 40 if args.quick else 200
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = all_rows(args)
    atomic_write_json(args.out_dir / "results.json", {"rows": rows})
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
