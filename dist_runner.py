"""One process per device: read the plan, join the group, run this rank's stage of the training.

    python dist_runner.py --plan plan.json --rank R (--dist-url | --coordinator) tcp://HOST:PORT \
        [--world-size N] (--data PATH[,...] | --fake-data) [--tokenizer tokenizer.json] --steps N \
    python dist_runner.py --model M [--stages S] --dist-url tcp://HOST:PORT --world-size N \
        --rank R [--sync diloco --inner-steps H] [--total-batch-size B] [--init-from DIR] \
        [--ckpt-dir D --ckpt-every K --keep-checkpoints N --resume] [--metrics metrics.jsonl]
        [--timeout-s T] [--heartbeat-timeout-s T] [--min-replicas K] [--replicas LIST] [--join]

Rank = device id in the plan. Without --plan the ranks build the obvious plan (N / S replicas of
S evenly split stages, rank r = stage r mod S of replica r div S) and print it. Under torchrun
the flags may be left out: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are read from the
environment. With --coordinator, a coordinator
process (scripts/coordinator.py) hosts the store and leads membership instead of rank 0.
Exit status: 0 done, 2 bad input (printed as `error: ...`), 1 a peer or the rendezvous did not
answer within --timeout-s, a peer's heartbeat stopped (allreduce), the store is gone, this
rank's replica was dropped (DiLoCo), fewer than --min-replicas replicas are left, the
coordinator is gone, or a checkpoint could not be written (--on-checkpoint-error stop).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# c10d's C++ logger prints stack traces for failures we turn into one clear message; set
# before anything imports torch (--init-from's checks do, before main's own import);
# TORCH_CPP_LOG_LEVEL=INFO shows them
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from formats.addresses import resolve, tcp_url  # noqa: E402
from formats.cluster import Cluster, load_cluster, save_cluster  # noqa: E402
from formats.errors import UserError  # noqa: E402
from formats.plan import Plan, load_plan  # noqa: E402
from formats.run_metrics import CLUSTER_NAME  # noqa: E402
from modules.config import LaunchConfig, LaunchTarget, ResolvedRun, RunConfig  # noqa: E402

if TYPE_CHECKING:
    import torch.distributed as dist

    from modules.control.dist import Topology
    from modules.data.tokenizer import TokenizerId
    from modules.device.placement import Placement
    from modules.sync.hivemind_outer import HivemindOuter
    from modules.train.trainer import Trainer


def build_parser() -> argparse.ArgumentParser:
    """The flags: one per field of modules.config's LaunchConfig and RunConfig."""
    from modules.cli_config import runner_parser

    return runner_parser()


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, RunConfig]:
    """Command-line flags -> (launch settings, run settings), each validated on its own."""
    from modules.cli_config import from_args

    args = build_parser().parse_args(argv)
    return from_args(LaunchConfig, args), from_args(RunConfig, args)


def resolve_launch(launch: LaunchConfig, num_devices: int) -> LaunchTarget:
    """Where this rank joins, from flags, else torchrun's environment; with --coordinator the
    coordinator hosts the store."""
    env = os.environ
    rank = launch.rank if launch.rank is not None else _env_int("RANK")
    if rank is None:
        raise UserError("--rank is required (or set RANK, as torchrun does)")
    world = launch.world_size if launch.world_size is not None else _env_int("WORLD_SIZE")
    world = num_devices if world is None else world
    url = launch.coordinator or launch.dist_url
    if url is None:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("--dist-url or --coordinator is required (or set MASTER_ADDR and "
                            "MASTER_PORT)")
        url = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    where = ("--coordinator" if launch.coordinator else "--dist-url" if launch.dist_url
             else "$MASTER_ADDR:$MASTER_PORT")
    resolve(tcp_url(url, where)[0], where)  # a name that does not resolve: exit 2 now
    agent_store = launch.dist_url is None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    coordinator = launch.coordinator is not None
    return LaunchTarget(rank=rank, world_size=world, url=url, coordinator=coordinator,
                        store_elsewhere=agent_store or coordinator)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"${name}: expected an integer, got {value!r}") from None


def resolve_run(launch: LaunchConfig, cfg: RunConfig) -> tuple[ResolvedRun, Cluster | None]:
    """The plan (and --cluster's cluster), checked against each other and the run's settings,
    and the launch target: the one record every later step reads. Without --plan, the obvious
    plan of --model, the world size and --stages (docs/models.md)."""
    from modules.plan_flags import check_model_flag, plan_without_file
    from scheduler.quick_plan import describe

    if launch.plan:
        plan, cluster = load_checked_plan(launch)
        check_model_flag(launch, plan)
        if launch.coordinator and cfg.overrides.given():
            raise UserError("--coordinator runs its own plan: put --sync, --inner-steps, "
                            "--outer-lr, --outer-momentum, --compression and the batch into "
                            "the plan (scheduler.py plan) instead of overriding them")
    else:
        plan, cluster = plan_without_file(launch, cfg), None
    cfg = hf_settings(cfg, plan)
    run = cfg.resolve(plan)  # the runner's overrides applied here, once
    if not launch.plan:
        print(f"no --plan: built {describe(run.plan)}", flush=True)
    if cluster is not None and cfg.metrics.run_dir:  # what `scheduler.py explain` reads
        save_cluster(cluster, Path(cfg.metrics.run_dir) / CLUSTER_NAME)
    target = resolve_launch(launch, len(plan.devices()))
    return dataclasses.replace(run, target=target), cluster


def load_checked_plan(launch: LaunchConfig) -> tuple[Plan, Cluster | None]:
    """--plan (and --cluster's cluster), checked against each other."""
    cluster = None
    if launch.cluster:
        cluster = load_cluster(launch.cluster)
    plan = load_plan(launch.plan, cluster)
    if cluster is not None and plan.cluster_sha256 and plan.cluster_sha256 != cluster.sha256():
        raise UserError(f"{launch.plan} was made for cluster '{plan.cluster}' with a different "
                        f"content than {launch.cluster} (cluster_sha256 differs); re-plan")
    return plan, cluster


def load_data(run: ResolvedRun, log=print):  # noqa: ANN201 - TextData | FakeData
    """The training text (or seeded fake tokens) the run reads, tokenized (modules.data.dataset)."""
    from modules.data.dataset import load_data as load

    return load(run.cfg.data, run.plan.model_spec(), run.cfg.seed, log)


def build_trainer(run: ResolvedRun, topo: Topology, placement: Placement, log,
                  hivemind: HivemindOuter | None = None) -> Trainer:
    """Load this rank's data, rendezvous, form the groups: a Trainer ready to run.
    `hivemind`: the outer sync goes through it; the store is my replica's own."""
    from modules.control.auth import Auth, load_secret
    from modules.control.dist import parse_dist_url, rendezvous
    from modules.control.fault import members_of
    from modules.train.ckpt_stop import start_note
    from modules.train.trainer import Trainer

    target, plan, el = run.target, run.plan, run.cfg.elastic
    assert target is not None
    store_addr = parse_dist_url(target.url, target.flag)
    start, join = run.start_replicas, el.join
    if start is not None and not join and topo.replica not in start:
        raise UserError(f"rank {target.rank} is in replica {topo.replica}, which is not in "
                        f"--replicas {el.replicas}; start it later with --join")
    auth = Auth(load_secret(), log)  # the run secret (docs/security.md); before slow work
    data = load_data(run, log)
    log(f"replica {topo.replica} stage {topo.stage} layers {list(plan.stages[topo.stage])} of "
        f"{plan.model}; sync {plan.sync.mode}; joining {target.url} as "
        f"{target.rank}/{target.world_size}{start_note(run.cfg.ckpt, run.cfg.steps)}")
    members = ((() if join else members_of(plan, start)) if start is not None or join
               else None)
    if hivemind is not None:  # the store is my replica's, hosted by its first device
        members = members_of(plan, [topo.replica])
    store = rendezvous(target.url, target.rank, target.world_size, run.cfg.timeout_s,
                       target.store_elsewhere, members=members,
                       on_store=lambda s: on_store(s, run, topo, data.tokenizer, placement),
                       auth=auth,
                       store_rank=members[0] if hivemind is not None else 0)
    # the Trainer forms generation 0's groups (or, on a joiner, waits to be admitted)
    return Trainer(run, topo, store, data, log=log, placement=placement, store_addr=store_addr,
                   hivemind=hivemind)


def start_hivemind(run: ResolvedRun, cluster: Cluster | None, topo: Topology,
                   log) -> HivemindOuter | None:
    """--outer-backend hivemind: start this rank's DHT node (printing the addresses to pass as
    --initial-peers) and make SIGTERM before training stop it cleanly (no orphaned p2pd)."""
    if run.cfg.hivemind.outer_backend != "hivemind":
        return None
    import signal

    from modules.control.auth import load_secret
    from modules.sync.hivemind_outer import HivemindOuter, settings_of

    assert run.target is not None
    if run.target.coordinator:
        raise UserError("--outer-backend hivemind: no --coordinator (replicas meet through the "
                        "DHT; start each with its own --dist-url)")
    # KeyboardInterrupt: a clean stop; from Trainer.run on, SIGTERM saves a checkpoint first
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return HivemindOuter(settings_of(run, load_secret()), run.plan, cluster, topo.replica,
                         topo.stage, log, topo.shard)


def on_store(store: dist.Store, run: ResolvedRun, topo: Topology,
             tokenizer: TokenizerId, placement: Placement) -> None:
    """As soon as the store answers: record who this rank is (named in failure messages) and
    its device, check that every rank has the same tokenizer, pipeline payload and DiLoCo
    schedule and, with --coordinator, this rank's plan and settings against the
    coordinator's."""
    from modules.comm.choice import announce_device, local_device
    from modules.control.agreement import agree_run
    from modules.control.coordinator import RunSettings, check_in
    from modules.control.fault import register
    from modules.control.hidden import hidden_store

    register(store, topo.rank, topo.replica, topo.stage)
    if placement.comm.backend != "gloo":  # before the rendezvous' barrier: every rank's device
        # is there once any rank chooses the backends (the GroupBuilder announces it again)
        announce_device(hidden_store(store), topo.rank, local_device(placement.comm.device))
    agree_run(store, run, tokenizer, topo.rank)
    target = run.target
    if target is not None and target.coordinator:
        check_in(store, run.plan, RunSettings.of(run), run.cfg.elastic.join, target.url,
                 run.cfg.timeout_s)


def hf_settings(cfg: RunConfig, plan: Plan) -> RunConfig:
    """Issue 25: check --init-from against the plan's model, take its tokenizer.json when
    --tokenizer is not given, keep the tokenizer with the checkpoints (for export_hf.py)."""
    from modules.train.hf_weights import check_init_from, init_tokenizer, keep_tokenizer

    if cfg.ckpt.init_from:
        check_init_from(cfg.ckpt.init_from, plan.model_spec())
    tokenizer = init_tokenizer(cfg.ckpt.init_from, cfg.data.tokenizer)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    if cfg.ckpt.dir:
        keep_tokenizer(cfg.ckpt.dir, tokenizer)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Parse and check everything that can be checked alone, then rendezvous and train."""
    launch, cfg = parse_args(argv)
    cfg.check_paths()
    run, cluster = resolve_run(launch, cfg)  # the one resolved record, passed down from here
    assert run.target is not None
    rank, plan, cfg = run.target.rank, run.plan, run.cfg
    # torch imports after the cheap checks, so bad input fails fast
    import torch
    import torch.distributed as dist

    from modules.control.dist import topology
    from modules.device.memory import check_stage_memory
    from modules.device.placement import resolve_placement
    from modules.device.select import describe_device
    from modules.train.outputs import check_outputs

    topo = topology(plan, rank, run.target.world_size)  # not in plan / world mismatch: exit 2
    check_outputs(cfg, topo)  # every file and folder this rank writes, before the rendezvous
    placement = resolve_placement(cfg, plan, topo.replica, cluster)  # bad device flags: exit 2
    check_stage_memory(plan, topo.stage, placement.device)  # before anything is allocated
    if cfg.device.threads:
        torch.set_num_threads(cfg.device.threads)
    # one write per line, newline included: with PYTHONUNBUFFERED (the launchers set it)
    # print writes the text and its newline apart, and srun merged two ranks' lines into one
    log = lambda msg: print(f"rank {rank}: {msg}\n", end="", flush=True)
    log(f"device {describe_device(placement.device)}, precision {cfg.device.precision}, "
        f"{'compiled' if placement.compile else 'eager'}, --comm {cfg.device.comm}, "
        f"pipeline compression {plan.pipeline_compression}")
    hivemind = start_hivemind(run, cluster, topo, log)
    try:
        trainer = build_trainer(run, topo, placement, log, hivemind)
        trainer.run()
        if hivemind is not None:  # a peer whose last round failed takes it from me meanwhile
            hivemind.linger()
    finally:
        if hivemind is not None:  # its DHT, averager and p2pd, also on Ctrl+C
            hivemind.close()
    mfu = trainer.mfu_values
    log(f"done; {trainer.dp_bytes} data-parallel bytes sent by this rank ({plan.sync.mode})"
        + (f"; mean MFU {sum(mfu) / len(mfu):.2%}" if mfu else ""))
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
    except Exception as e:  # a lost peer or a diverged run: exit 1; anything else is a bug
        from modules.control.dist import PeerError
        from modules.train.trainer import TrainingDiverged
        if not isinstance(e, PeerError | TrainingDiverged):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown, also after a clean run (checkpoints, metrics and trackers
    # are flushed and closed by now): on failure gloo's destructors may wait on peers that are
    # gone, and after success gloo work objects still held by its C++ threads can abort the
    # finalization ("terminate called without an active exception", seen once in ~10 runs on
    # the namespace lab; pytorch/pytorch#179291 describes the mechanism).
    os._exit(code)


if __name__ == "__main__":
    entry()
