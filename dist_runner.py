"""One process per device: read the plan, join the group, run this rank's stage of the training.

    python dist_runner.py --plan plan.json --rank R --dist-url tcp://HOST:PORT \
        [--world-size N] (--data PATH | --fake-data) --steps N \
        [--ckpt-dir D --ckpt-every K --keep-checkpoints N --resume] [--metrics metrics.jsonl]
        [--timeout-s T] [--heartbeat-timeout-s T] [--min-replicas K] [--replicas LIST] [--join]

Rank = device id in the plan. Under torchrun the flags may be left out: RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT are read from the environment.
Exit status: 0 done, 2 bad input (printed as `error: ...`), 1 a peer or the rendezvous did not
answer within --timeout-s, a peer's heartbeat stopped (allreduce), the store is gone, this
rank's replica was dropped (DiLoCo), or fewer than --min-replicas replicas are left.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from formats.errors import UserError  # noqa: E402
from formats.plan import load_plan  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = argparse.ArgumentParser(
        description="Run one rank (= device id) of a plan: its pipeline stage of its replica.")
    p.add_argument("--plan", required=True, help="plan/1 JSON file")
    p.add_argument("--rank", type=int, help="device id of this process (default: $RANK)")
    p.add_argument("--world-size", type=int,
                   help="number of processes (default: $WORLD_SIZE, else the plan's devices)")
    p.add_argument("--dist-url", help="rendezvous tcp://HOST:PORT, hosted by rank 0 "
                   "(default: tcp://$MASTER_ADDR:$MASTER_PORT)")
    p.add_argument("--cluster", help="cluster/1 file: check that the plan was made for it")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=None,
                     help="text file or folder (default: /usr/share/games/fortunes, Debian's "
                     "fortunes packages)")
    src.add_argument("--fake-data", action="store_true", help="seeded random tokens (speed tests)")
    p.add_argument("--steps", type=int, required=True, help="train until this step (total)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW (inner) learning rate")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after warm-up: constant, or cosine decay to 0.1 x lr at --steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    p.add_argument("--ckpt-dir", help="folder for per-rank checkpoints (rank{R}/step{S}.pt), "
                   "written in the background from a memory snapshot (temp file + rename)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="save every K steps and at the end (default with --ckpt-dir: at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2,
                   help="complete checkpoints kept per rank, newest first (default 2)")
    p.add_argument("--sync-checkpoints", action="store_true",
                   help="write checkpoints on the training thread (slower; for comparison)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest step of --ckpt-dir that every rank has "
                   "completely written")
    p.add_argument("--metrics", help="metrics file, e.g. m.jsonl (replica r>0 writes m.r{r}.jsonl)")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every K steps")
    p.add_argument("--eval-sequences", type=int, default=0,
                   help="validation sequences per evaluation (0: none; always at the end if >0)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="how long any wait on a peer or the rendezvous may take")
    p.add_argument("--wait-for-peers", action="store_true",
                   help="DiLoCo: wait (and log) for a missing peer at an outer step instead of "
                   "failing")
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                   help="a peer whose heartbeat (every ~1 s through the rendezvous store) is "
                   "older than this is gone: allreduce stops (checkpoint, exit 1), DiLoCo drops "
                   "its replica and goes on; also how long the store may stay silent")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="DiLoCo: stop (checkpoint, exit 1) when fewer replicas are alive "
                   "(default: 2, or 1 for a one-replica plan)")
    p.add_argument("--replicas", default=None,
                   help="DiLoCo: comma-separated replicas of the plan that start now (default "
                   "all); the others can be added later with --join")
    p.add_argument("--join", action="store_true",
                   help="DiLoCo: join a running job: fetch the outer model and momentum of my "
                   "stage from a live peer and take part from the next outer step")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    # tests only: RANK:STEP[:STATUS] makes that rank exit before STEP (a lost peer)
    p.add_argument("--debug-vanish", default="", help=argparse.SUPPRESS)
    # tests only: RANK:STEP SIGKILLs that rank when its checkpoint of STEP is half written
    p.add_argument("--debug-ckpt-die", default="", help=argparse.SUPPRESS)
    p.add_argument("--log-every", type=int, default=1, help="print a progress line every K steps")
    return p.parse_args(argv)


def resolve_launch(args: argparse.Namespace, num_devices: int) -> tuple[int, int, str, bool]:
    """(rank, world_size, dist_url, agent_store) from flags, else torchrun's environment."""
    env = os.environ
    rank = args.rank if args.rank is not None else _env_int("RANK")
    if rank is None:
        raise UserError("--rank is required (or set RANK, as torchrun does)")
    world = args.world_size if args.world_size is not None else _env_int("WORLD_SIZE")
    world = num_devices if world is None else world
    url = args.dist_url
    if url is None:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("--dist-url is required (or set MASTER_ADDR and MASTER_PORT)")
        url = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    agent_store = args.dist_url is None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return rank, world, url, agent_store


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"${name}: expected an integer, got {value!r}") from None


def _vanish(spec: str, rank: int) -> tuple[int, int]:
    """RANK:STEP[:STATUS] -> (step, status) for that rank, (0, 0) for the others."""
    if not spec:
        return 0, 0
    who, step, *status = (int(v) for v in spec.split(":"))
    return (step, status[0] if status else 0) if who == rank else (0, 0)


def _replicas(spec: str | None, num_replicas: int) -> tuple[int, ...] | None:
    """--replicas "0,1" -> (0, 1); None when not given."""
    if spec is None:
        return None
    try:
        out = tuple(sorted({int(v) for v in spec.split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--replicas: expected comma-separated numbers, got {spec!r}") from None
    if not out or not all(0 <= r < num_replicas for r in out):
        raise UserError(f"--replicas: must name replicas 0..{num_replicas - 1}, got {spec!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Validate everything that can be checked alone, then rendezvous and train."""
    args = parse_args(argv)
    cluster = None
    if args.cluster:
        from formats.cluster import load_cluster
        cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan, cluster)
    if cluster is not None and plan.cluster_sha256 and plan.cluster_sha256 != cluster.sha256():
        raise UserError(f"{args.plan} was made for cluster '{plan.cluster}' with a different "
                        f"content than {args.cluster} (cluster_sha256 differs); re-plan")
    if args.steps < 1:
        raise UserError(f"--steps: must be >= 1, got {args.steps}")
    if args.timeout_s <= 0:
        raise UserError(f"--timeout-s: must be > 0, got {args.timeout_s}")
    if args.keep_checkpoints < 1:
        raise UserError(f"--keep-checkpoints: must be >= 1, got {args.keep_checkpoints}")
    if args.resume and not args.ckpt_dir:
        raise UserError("--resume needs --ckpt-dir")
    rank, world, url, agent_store = resolve_launch(args, len(plan.devices()))
    if args.heartbeat_timeout_s <= 0:
        raise UserError(f"--heartbeat-timeout-s: must be > 0, got {args.heartbeat_timeout_s}")
    start = _replicas(args.replicas, plan.num_replicas)
    if (args.join or start is not None) and plan.sync.mode != "diloco":
        raise UserError("--join and --replicas need sync mode diloco (allreduce has no slack "
                        "for a replica to come and go)")
    if args.join and args.resume:
        raise UserError("--join fetches its state from a live peer; it cannot --resume")
    live = len(start) if start is not None else plan.num_replicas
    min_replicas = args.min_replicas if args.min_replicas is not None else min(2, live)
    if not 1 <= min_replicas <= plan.num_replicas:
        raise UserError(f"--min-replicas: must be between 1 and the plan's "
                        f"{plan.num_replicas} replicas, got {min_replicas}")

    # torch imports after the cheap checks, so bad input fails fast. c10d's C++ logger prints
    # stack traces for timeouts we turn into one clear message; TORCH_CPP_LOG_LEVEL=INFO shows them
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    import torch

    from formats.models import get_model
    from modules.data import DEFAULT_CORPUS, FakeData, TextData, load_tokens
    from modules.dist import parse_dist_url, rendezvous, topology
    from modules.fault import members_of, register
    from modules.sync import check_compression
    from modules.trainer import RunConfig, Trainer

    topo = topology(plan, rank, world)  # rank not in plan / world size mismatch: exit 2 here
    check_compression(plan.sync.compression, plan.num_replicas)
    store_addr = parse_dist_url(url)
    if start is not None and not args.join and topo.replica not in start:
        raise UserError(f"rank {rank} is in replica {topo.replica}, which is not in --replicas "
                        f"{args.replicas}; start it later with --join")
    spec = get_model(plan.model)
    if args.fake_data:
        data = FakeData(spec.seq_len, spec.vocab_size, seed=args.seed)
    else:
        data = TextData(load_tokens(args.data or DEFAULT_CORPUS), spec.seq_len, spec.vocab_size,
                        seed=args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RunConfig(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                    warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
                    timeout_s=args.timeout_s, ckpt_dir=args.ckpt_dir,
                    ckpt_every=args.ckpt_every or (args.steps if args.ckpt_dir else 0),
                    keep_checkpoints=args.keep_checkpoints,
                    sync_checkpoints=args.sync_checkpoints,
                    debug_ckpt_die=_vanish(args.debug_ckpt_die, rank)[0],
                    store_addr=store_addr, heartbeat_timeout_s=args.heartbeat_timeout_s,
                    min_replicas=min_replicas, start_replicas=start, join=args.join,
                    resume=args.resume, metrics=args.metrics, eval_every=args.eval_every,
                    eval_sequences=args.eval_sequences, wait_for_peers=args.wait_for_peers,
                    log_every=max(1, args.log_every),
                    debug_vanish=_vanish(args.debug_vanish, rank))
    log = lambda msg: print(f"rank {rank}: {msg}", flush=True)
    log(f"replica {topo.replica} stage {topo.stage} layers {list(plan.stages[topo.stage])} of "
        f"{plan.model}; sync {plan.sync.mode}; joining {url} as {rank}/{world}")
    members = (() if args.join else members_of(plan, start)) if start is not None or args.join \
        else None
    store = rendezvous(url, rank, world, args.timeout_s, agent_store, members=members,
                       on_store=lambda s: register(s, rank, topo.replica, topo.stage))
    trainer = Trainer(plan, topo, store, data, cfg, log=log)  # forms generation 0's groups
    trainer.run()
    log(f"done; {trainer.dp_bytes} data-parallel bytes sent by this rank ({plan.sync.mode})")
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


def entry() -> None:
    """Run main(); user errors exit 2, peer/rendezvous failures exit 1, without tracebacks."""
    try:
        code = main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except KeyboardInterrupt:
        code = 130
    except RuntimeError as e:
        from modules.dist import PeerError
        if not isinstance(e, PeerError):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown on failure: gloo's destructors may wait on peers that are gone
    os._exit(code) if code else sys.exit(0)


if __name__ == "__main__":
    entry()
