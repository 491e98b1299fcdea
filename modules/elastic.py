"""Failure handling and elastic membership of a rank: heartbeats, generations, join, commit.

`ElasticMembership` is mixed into modules.trainer.Trainer and works on its attributes (plan,
topo, cfg, store, comm, opt, model, groups, replicas, active, gen, monitor, state_lock, ckpt).
What it does:
- start the heartbeat thread (modules.fault.Monitor) and die cleanly, checkpointing first, when
  a peer or the store is lost in allreduce mode (`_on_fatal`);
- DiLoCo: follow the generations rank 0 publishes (re-form the gloo groups over the live
  replicas under a fresh PrefixStore), wait for every member at each outer step, average, and
  commit only if every member of every stage got the average (else retry in the next
  generation), so that no rank ever takes an outer step alone;
- `--join`: fetch the outer model and Nesterov state of my stage from a live peer
  point-to-point and take part in the next outer step with weight 0.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from modules.checkpoint import save_checkpoint, snapshot, step_path
from modules.comm import PeerError
from modules.diloco import DiLoCoOptimizer
from modules.dist import build_groups
from modules.fault import Generation, Monitor, MonitorConfig, members_of, publish

JOIN_TAG = 1 << 22
"""Point-to-point tags of the outer state sent to a joining replica."""


class ElasticMembership:
    """Trainer's failure detection and DiLoCo membership (see the module docstring)."""
    def start_monitor(self) -> None:
        """Start the heartbeat thread (its own store connection); rank 0 publishes generation 0."""
        cfg, plan = self.cfg, self.plan
        if cfg.store_addr is None:
            return
        elastic = plan.sync.mode == "diloco"
        members = members_of(plan, self.replicas)
        if self.topo.rank == 0 and not cfg.join:
            publish(self.store, Generation(0, tuple(self.replicas), members, reason="start"))
        self.monitor = Monitor(MonitorConfig(
            rank=self.topo.rank, host=cfg.store_addr[0], port=cfg.store_addr[1], plan=plan,
            timeout_s=cfg.heartbeat_timeout_s,
            interval_s=min(1.0, cfg.heartbeat_timeout_s / 4), elastic=elastic,
            min_replicas=cfg.min_replicas, members=() if cfg.join else members, log=self.log,
            on_fatal=self._on_fatal))
        self.monitor.start()

    def _on_fatal(self, reason: str) -> None:
        """Say why, checkpoint what can be checkpointed, and leave with status 1 (any thread)."""
        print(f"rank {self.topo.rank}: error: {reason}", file=sys.stderr, flush=True)
        try:
            saved = self.emergency_checkpoint()
        except Exception as e:  # never let a failed save keep a dying rank alive
            saved = f"no checkpoint ({type(e).__name__}: {e})"
        if saved:
            self.log(saved)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def emergency_checkpoint(self) -> str:
        """Finish the write in flight, then save the current state if the training thread is
        not inside an update (it is usually blocked waiting on the lost peer)."""
        if self.ckpt is None or not self.cfg.ckpt_dir:
            return ""
        if not self.ckpt.flush(timeout=2.0):
            return "checkpoint: the background write did not finish within 2 s"
        if self.plan.sync.mode == "diloco" or not self.state_lock.acquire(timeout=1.0):
            last = self.ckpt.last_step
            return (f"checkpoint: newest complete one is step {last}" if last is not None
                    else "checkpoint: none written yet")
        # keep the lock: the training thread must not change the state while it is saved
        if self.step == 0 or self.ckpt.last_step == self.step:
            return f"checkpoint: step {self.step} is already on disk"
        path = step_path(self.cfg.ckpt_dir, self.topo.rank, self.step)
        save_checkpoint(path, self._meta(), snapshot(self.state()))
        return f"checkpoint: saved step {self.step} to {path}"

    def await_verdict(self) -> None:
        """After a PeerError: give the heartbeat time to name the lost peer (it exits then)."""
        mon = self.monitor
        if mon is None:
            return
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 3
        gen = self.gen
        while time.monotonic() < deadline and not mon.dropped:
            if mon.gen > gen and self.plan.sync.mode == "diloco":
                time.sleep(0.5)  # the monitor exits if my replica was dropped
            mon.changed.wait(0.2)
            mon.changed.clear()

    def finish(self) -> None:
        """End of the run: nobody leaves before every rank is done (rank 0 hosts the store)."""
        mon = self.monitor
        if mon is None or self.plan.sync.mode == "allreduce":
            self.groups.world.barrier("final barrier with every rank")
        if mon is None:
            return
        if self.topo.rank != 0:
            mon.stop()
            mon.join(timeout=5)
            self.store.add(f"ft/done/{self.topo.rank}", 1)
            return
        self.store.add("ft/done/0", 1)
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:  # members that are lost meanwhile are dropped by the monitor
            left = [r for r in mon.members if r != 0 and self.store.add(f"ft/done/{r}", 0) == 0]
            if not left:
                break
            if time.monotonic() > deadline and self.plan.sync.mode == "allreduce":
                raise PeerError(f"end of run: rank(s) {left} did not finish within "
                                f"{self.cfg.timeout_s:g} s")
            time.sleep(0.1)
        mon.stop()

    def join(self) -> None:
        """--join: ask to be admitted, form the groups with the live replicas, fetch the outer
        state of my stage from a live peer and take part in the next outer step."""
        mon = self.monitor
        assert mon is not None and isinstance(self.opt, DiLoCoOptimizer)
        t0 = time.monotonic()
        try:
            self.store.add(f"ft/join/{self.topo.rank}", 1)
        except RuntimeError as e:
            raise PeerError(f"--join: the rendezvous store does not answer (the run is over or "
                            f"rank 0 is gone): {str(e).strip()[:200]}") from None
        self.log(f"asking to join the run with replica {self.topo.replica}")
        while mon.generation is None or self.topo.rank not in mon.generation.members:
            if time.monotonic() - t0 > self.cfg.timeout_s:
                raise PeerError(f"--join: not admitted within {self.cfg.timeout_s:g} s (is the "
                                "run alive, and did every rank of my replica start with --join?)")
            mon.changed.wait(0.2)
            mon.changed.clear()
        self.gen = -1
        self._sync_generation()  # re-forms the groups and receives the state
        self.opt.outer_step()  # pseudo-gradient 0, weight 0: the same outer step as everybody
        self.step = self._join_step
        self.rejoin_s = time.monotonic() - t0
        self.log(f"joined at step {self.step} (outer step {self.opt.outer_count}) after "
                 f"{self.rejoin_s:.2f} s")

    def _sync_generation(self) -> bool:
        """Re-form the process groups if a newer generation was published; True if so."""
        mon = self.monitor
        if mon is None or mon.generation is None or mon.gen <= self.gen:
            return False
        g = mon.generation
        if self.topo.rank not in g.members or g.stop:
            if not mon.dropped:
                mon.changed.wait(self.cfg.heartbeat_timeout_s)  # the monitor is exiting
            raise PeerError(f"generation {g.gen} does not continue with me ({g.reason})")
        t0 = time.monotonic()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{g.gen}", self.store),
                                    rank=g.members.index(self.topo.rank),
                                    world_size=len(g.members),
                                    timeout=timedelta(seconds=self.cfg.timeout_s))
        except (RuntimeError, OSError) as e:
            raise PeerError(f"re-forming the groups of generation {g.gen}: not every member "
                            f"{list(g.members)} came within {self.cfg.timeout_s:g} s "
                            f"({str(e).strip().splitlines()[0][:200] if str(e) else e})") \
                from None
        self.replicas = sorted(g.replicas)
        self._set_groups(build_groups(self.plan, self.topo, self.spec.tie_embeddings,
                                      self.replicas, {d: i for i, d in enumerate(g.members)},
                                      self.cfg.timeout_s, self.stats))
        self.gen = g.gen
        self.log(f"generation {g.gen}: groups re-formed over replicas {self.replicas} in "
                 f"{time.monotonic() - t0:.2f} s ({g.reason})")
        if len(self.replicas) == 1:
            self.log(f"warning: replica {self.replicas[0]} is the only one left; outer steps "
                     f"average over it alone (--min-replicas {self.cfg.min_replicas})")
        self._exchange_outer_state()
        return True

    def _exchange_outer_state(self) -> None:
        """After re-forming: a live peer of my stage sends the outer state to each joiner."""
        joiners = [r for r in self.replicas if r not in self.active]
        if not joiners:
            return
        stage = self.topo.stage
        key = f"ft/src/g{self.gen}/s{stage}"
        if self.topo.replica in joiners:
            self.store.wait([key], timedelta(seconds=self.cfg.timeout_s))
            src = int(self.store.get(key))
            self._recv_outer_state(src)
            return
        source = self.plan.pipelines[min(set(self.replicas) & self.active)][stage]
        if self.topo.rank != source:
            return
        self.store.set(key, str(source))
        for r in joiners:
            dst = self.plan.pipelines[r][stage]
            self._send_outer_state(dst)

    def _outer_header(self) -> torch.Tensor:
        opt = self.opt
        R = self.plan.num_replicas
        has_mom = int(bool(opt.outer.state))
        active = sorted(self.active) + [-1] * (R - len(self.active))
        return torch.tensor([self.step + 1, opt.outer_count, has_mom, *active], dtype=torch.int64)

    def _send_outer_state(self, dst: int) -> None:
        """Anchor (outer model), Nesterov momentum and counters to the joiner `dst`."""
        opt = self.opt
        header = self._outer_header()
        anchor = torch.cat([a.reshape(-1) for a in opt.anchor])
        mom = torch.cat([opt.outer.state[p]["momentum_buffer"].reshape(-1)
                         if p in opt.outer.state and opt.outer.state[p].get("momentum_buffer")
                         is not None else torch.zeros(p.numel()) for p in opt.params])
        t0 = time.monotonic()
        comm = self.groups.stage
        posted = [comm.isend(t, dst, JOIN_TAG + i) for i, t in enumerate((header, anchor, mom))]
        for p in posted:
            comm.wait(p, "sending the outer state to a joining rank")
        self.log(f"sent the outer state of stage {self.topo.stage} to joining rank {dst} in "
                 f"{time.monotonic() - t0:.2f} s")

    @torch.no_grad()
    def _recv_outer_state(self, src: int) -> None:
        """Receive what _send_outer_state sent; parameters and anchor become the outer model."""
        opt = self.opt
        comm = self.groups.stage
        header = comm.recv(torch.empty(3 + self.plan.num_replicas, dtype=torch.int64), src,
                           JOIN_TAG, "outer state header")
        n = sum(p.numel() for p in opt.params)
        anchor = comm.recv(torch.empty(n), src, JOIN_TAG + 1, "outer model")
        mom = comm.recv(torch.empty(n), src, JOIN_TAG + 2, "outer momentum")
        self._join_step, opt.outer_count = int(header[0]), int(header[1])
        self.active = {int(r) for r in header[3:] if int(r) >= 0}
        off = 0
        for a, p in zip(opt.anchor, opt.params):
            k = p.numel()
            a.copy_(anchor[off:off + k].view_as(a))
            p.copy_(a)
            if int(header[2]):
                opt.outer.state[p]["momentum_buffer"] = mom[off:off + k].view_as(p).clone()
            off += k
        opt.inner_count = 0
        self.log(f"received the outer model and momentum of stage {self.topo.stage} from rank "
                 f"{src} (outer step {opt.outer_count}, continuing at step {self._join_step})")

    def _elastic_outer_all_reduce(self, flat: torch.Tensor) -> int:
        """Outer average over the live replicas of my stage: re-form groups when the membership
        changed, wait for every member, average, and commit only if every rank of every stage
        got its average (otherwise all retry in the next generation, so that every stage
        re-forms at the same outer step and no pipeline waits on a partner in another group)."""
        keep = flat.clone()
        stage = self.topo.stage
        while True:
            self._sync_generation()
            if self.topo.replica not in self.active:  # joining: contribute nothing
                keep.zero_()
                flat.zero_()
            ranks = self._stage_ranks()
            outer = self.opt.outer_count
            key = f"diloco/g{self.gen}/stage{stage}/outer{outer}"
            what = f"DiLoCo outer step {outer + 1} of stage {stage}"
            sent = 0
            if len(ranks) > 1:
                t0 = time.perf_counter()
                ok = self._wait_members(key, ranks, what)
                self.stats.wait_s += time.perf_counter() - t0
                if not ok:
                    flat.copy_(keep)
                    continue
                try:
                    sent = self.average(flat)
                except PeerError:
                    if not self._await_generation(self.gen):
                        raise
                    flat.copy_(keep)
                    continue
            members = members_of(self.plan, self.replicas)
            if len(members) > 1 and not self._commit(f"diloco/g{self.gen}/outer{outer}",
                                                     members, what):
                flat.copy_(keep)
                continue
            n_active = len(set(self.replicas) & self.active)
            if n_active < len(self.replicas):  # joiners sent zeros: average over the others
                flat.mul_(len(self.replicas) / n_active)
            self.active = set(self.replicas)
            self.dp_bytes += sent
            return sent

    def _await_generation(self, gen: int) -> bool:
        """Wait (heartbeat timeout + 5 s) for a generation newer than `gen`; True if one came."""
        mon = self.monitor
        deadline = time.monotonic() + self.cfg.heartbeat_timeout_s + 5
        while mon is not None and time.monotonic() < deadline:
            if mon.gen > gen:
                return True
            mon.changed.wait(0.2)
            mon.changed.clear()
        return False

    def _wait_members(self, key: str, ranks: tuple[int, ...], what: str) -> bool:
        """Announce `key` and wait for every member; False if the membership changed first."""
        mon = self.monitor
        assert mon is not None
        self.store.set(f"{key}/{self.topo.rank}", "1")
        keys = [f"{key}/{r}" for r in ranks]
        t0 = time.monotonic()
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=0.5))
                return True
            except RuntimeError as e:
                if mon.gen > self.gen:
                    return False
                if time.monotonic() - t0 < self.cfg.timeout_s:
                    continue
                try:
                    missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                except RuntimeError:
                    raise PeerError(f"{what}: the rendezvous store (hosted by rank 0) is gone "
                                    f"({str(e).strip()[:200]})") from None
                if not missing:
                    return True
                msg = (f"{what}: rank(s) {missing} of my group {list(ranks)} did not arrive "
                       f"within {self.cfg.timeout_s:g} s")
                if not self.cfg.wait_for_peers:
                    err = PeerError(msg + "; not stepping alone (pass --wait-for-peers to wait)")
                    err.diagnosed = True  # type: ignore[attr-defined]
                    raise err from None
                self.log(f"warning: {msg}; still waiting (--wait-for-peers)")
                t0 = time.monotonic()

    def _commit(self, key: str, ranks: tuple[int, ...], what: str) -> bool:
        """Every member (all stages) finished its all-reduce -> commit; the membership changed
        first -> abort (everybody retries with the new groups). One decision per key, first
        writer wins."""
        mon = self.monitor
        assert mon is not None
        self.store.set(f"{key}/done/{self.topo.rank}", "1")
        keys = [f"{key}/done/{r}" for r in ranks]
        t0 = time.monotonic()
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=0.5))
                decision = "commit"
            except RuntimeError:
                if mon.gen <= self.gen:
                    if time.monotonic() - t0 > self.cfg.timeout_s + self.cfg.heartbeat_timeout_s:
                        raise PeerError(f"{what}: not every member confirmed the average "
                                        f"within {self.cfg.timeout_s:g} s") from None
                    continue
                decision = "abort"
            got = self.store.compare_set(f"{key}/decision", "", decision)
            if got != b"commit":
                self.log(f"{what}: aborted at generation {self.gen} (membership changed); "
                         "retrying with the live replicas")
            return got == b"commit"
