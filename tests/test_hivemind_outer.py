"""--outer-backend hivemind (modules/sync/hivemind_outer.py, hivemind_exact.py,
modules/sync/hivemind_dht.py): our codec inside hivemind gives the store backend's bytes and
result; replicas on loopback end bit-identical; a late joiner loads state and catches up; a
killed replica is dropped; an unreachable DHT node and malformed multiaddresses are refused by
name (exit 2); SIGTERM stops a replica without leaving its p2pd. No p2pd outlives a test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")

from formats.addresses import parse_maddrs  # noqa: E402
from formats.errors import UserError  # noqa: E402
from modules.comm import PeerError  # noqa: E402
from modules.control.signals import TERM_STATUS  # noqa: E402
from modules.quant.allreduce import encode_chunk, reference_compressed_mean  # noqa: E402
from modules.sync.diloco import DiLoCoOptimizer, OuterRoundSkipped, OuterState  # noqa: E402
from modules.sync.hivemind_dht import SplitGuard, start_dht, visible_maddrs  # noqa: E402
from modules.sync.hivemind_exact import CodecWire, ExactAverager, reducer_of  # noqa: E402
from modules.sync.hivemind_offenders import Offenders  # noqa: E402
from testkit.fault_harness import write_trial_plan  # noqa: E402
from testkit.hivemind_runs import (  # noqa: E402
    FakeDHT,
    HivemindRun,
    load_models,
    max_param_diff,
)

LOOP = ["/ip4/127.0.0.1/tcp/0"]


def _g(replica: int, index: int) -> dict:
    """A peer's gathered data in a matched group (HivemindOuter._step's gather, identity "")."""
    return {"replica": replica, "round": index, "id": ""}
FAKE_ID = "12D3KooWBpJ5MYtL1QxfmJV1CyweZGo8w2zuDEW3J5E9z6P7oJra"


def _average(dhts, inputs, compression, prefix, replicas):
    """One round of ExactAverager over `dhts` (peer i is replica replicas[i]; a client-mode
    DHT gives a client-mode averager); the results."""
    avs = [ExactAverager([x.clone()], d, wire=CodecWire(compression), start=True, prefix=prefix,
                         target_group_size=len(dhts), min_matchmaking_time=10.0,
                         request_timeout=2.0, sender_timeout=20, reducer_timeout=40)
           for d, x in zip(dhts, inputs)]
    errors = []

    def go(i):
        try:
            avs[i].step(gather={"replica": replicas[i]}, timeout=40)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(avs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    outs = []
    for a in avs:
        with a.get_tensors() as ts:
            outs.append(ts[0].clone())
        a.shutdown()
    assert not errors, errors
    return outs


@pytest.mark.timeout(90)
def test_codec_inside_hivemind_equals_the_store_backends():
    """Three peers, int8 and fp16: every peer ends with the same bytes, equal to
    reference_compressed_mean (what the store backend's compressed mean all-reduce gives,
    tests/test_quant_allreduce.py) with ranks in replica order; the wire carries our codes."""
    first = start_dht([], LOOP, [], False, 30)
    dhts = [first] + [start_dht(visible_maddrs(first), LOOP, [], False, 30) for _ in range(2)]
    try:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(70_001, generator=g) * (i + 1) for i in range(3)]
        replicas = [2, 0, 1]  # peer i is replica replicas[i]: order by replica, not by peer
        in_replica_order = [inputs[replicas.index(r)] for r in range(3)]
        for compression in ("int8", "fp16"):
            outs = _average(dhts, inputs, compression, f"t{compression}", replicas)
            ref = reference_compressed_mean(in_replica_order, compression)
            for o in outs:
                assert torch.equal(o, ref), (compression, float((o - ref).abs().max()))
            wire = CodecWire(compression).compress(inputs[0][:1000])
            theirs = encode_chunk(inputs[0][:1000], compression, 256)[0]
            assert wire.buffer == theirs.contiguous().view(torch.uint8).numpy().tobytes()
        assert len(CodecWire("int8").compress(inputs[0]).buffer) < inputs[0].numel() * 1.02
    finally:
        for d in dhts:
            d.shutdown()


@pytest.mark.timeout(90)
def test_client_mode_peers_average_exactly_through_the_others():
    """Four peers, two in --client-mode (they accept no incoming streams, so they reduce
    nothing): their chunks are reduced by the others in the owner's order, so every peer
    still ends with reference_compressed_mean's bytes, the store backend's result."""
    first = start_dht([], LOOP, [], False, 30)
    dhts = [first] + [start_dht(visible_maddrs(first), LOOP, [], client, 30)
                      for client in (False, True, True)]
    try:
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(50_003, generator=g) * (i + 1) for i in range(4)]
        replicas = [0, 2, 1, 3]  # the clients are replicas 1 and 3: chunks 1 and 3 move
        in_replica_order = [inputs[replicas.index(r)] for r in range(4)]
        outs = _average(dhts, inputs, "int8", "tclient", replicas)
        ref = reference_compressed_mean(in_replica_order, "int8")
        for o in outs:
            assert torch.equal(o, ref), float((o - ref).abs().max())
    finally:
        for d in dhts:
            d.shutdown()


def test_chunks_of_client_peers_go_to_the_others_in_turn():
    """reducer_of: a client's chunk to the accepting peers cyclically; none accepting: error."""
    assert reducer_of(4, set()) == [0, 1, 2, 3]
    assert reducer_of(4, {1, 3}) == [0, 0, 2, 2]
    assert reducer_of(5, {0, 1, 2}) == [3, 4, 3, 3, 4]
    with pytest.raises(Exception, match="client mode"):
        reducer_of(2, {0, 1})


def test_round_skipped_keeps_local_params_or_takes_the_state():
    """OuterRoundSkipped(None): no outer step, the local pseudo-gradient stays; with a state:
    that state's outer model becomes the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    calls = []

    def failing(flat):
        calls.append(flat.clone())
        raise OuterRoundSkipped(None if len(calls) == 1 else state)

    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DiLoCoOptimizer(model.parameters(), inner, inner_steps=1, all_reduce_fn=failing)
    anchor0 = [a.clone() for a in opt.anchor]
    model(torch.ones(4)).sum().backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.anchor, anchor0))  # skipped
    assert not torch.equal(model.weight, anchor0[0])  # local params kept
    n = sum(p.numel() for p in model.parameters())
    state = OuterState(torch.arange(n, dtype=torch.float32), torch.ones(n), 7)
    opt.zero_grad()
    model(torch.ones(4)).sum().backward()
    opt.step()
    assert opt.outer_count == 7 and opt.syncs == 7
    assert torch.equal(model.weight.detach().reshape(-1), state.anchor[:16])


def test_split_guard_names_the_initial_peers():
    lines = []
    guard = SplitGuard(3, 5.0, ["/ip4/10.0.0.1/tcp/1/p2p/X"], lines.append)
    assert not guard.check({0, 1}, now=0.0)
    assert not guard.check({0, 1}, now=4.0)
    assert guard.check({0, 1}, now=6.0)
    assert "/ip4/10.0.0.1/tcp/1/p2p/X" in lines[0] and "[0, 1]" in lines[0]
    assert not guard.check({0, 1}, now=20.0)  # once per episode
    assert not guard.check({0, 1, 2}, now=21.0)


@pytest.mark.parametrize("text,needle", [
    ("garbage", "'garbage' is not a multiaddress"),
    ("/ip4/1.2.3/tcp/5/p2p/" + FAKE_ID, "is not a multiaddress"),
    ("/ip4/127.0.0.1/tcp/99999/p2p/" + FAKE_ID, "is not a multiaddress"),
    ("/ip4/127.0.0.1/tcp/5", "has no /p2p/<peer id> part"),
])
def test_malformed_multiaddress_refused_by_name(text, needle):
    with pytest.raises(UserError, match="--initial-peers") as e:
        parse_maddrs(f"/ip4/127.0.0.1/tcp/5/p2p/{FAKE_ID},{text}", "--initial-peers")
    assert needle in str(e.value)


def _plan(tmp_path, replicas, inner_steps=5):
    return write_trial_plan(tmp_path / "plan.json", replicas, 1, "diloco",
                            inner_steps=inner_steps)


@pytest.mark.timeout(60)
def test_malformed_and_unreachable_initial_peers_exit_2(tmp_path):
    """dist_runner: a malformed address and an unreachable DHT node both exit 2 with one line
    naming it, the unreachable one within --timeout-s."""
    run = HivemindRun(_plan(tmp_path, 2), tmp_path)
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{FAKE_ID}"
    run.start(0, "--steps", "5", "--fake-data", peers="/ip4/127.0.0.1/tcp/x")
    t0 = time.monotonic()
    run.start(1, "--steps", "5", "--fake-data", "--timeout-s", "20", peers=dead)
    try:
        codes = run.wait(50)
        took = time.monotonic() - t0
        assert codes == {0: 2, 1: 2}, (run.output(0), run.output(1))
        assert "--initial-peers: '/ip4/127.0.0.1/tcp/x' is not a multiaddress" in run.output(0)
        out = run.output(1)
        assert f"error: --initial-peers: could not join the DHT through {dead}" in out, out
        assert "Traceback" not in out and took < 45, (took, out)
        assert run.p2pd_left() == []  # before any kill: they left nothing running
    finally:
        run.stop()


def _start_replicas(run, n, steps, *extra):
    run.start(0, "--steps", str(steps), "--ckpt-dir", str(run.out_dir / "ck"), *extra)
    peers = run.peers_of(0)
    for r in range(1, n):
        run.start(r, "--steps", str(steps), "--ckpt-dir", str(run.out_dir / "ck"), *extra,
                  peers=peers)
    return peers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_reach_identical_parameters(tmp_path, replicas):
    """2 and 3 replicas, int8 outer payload: after the last round every replica holds the same
    parameters, bit for bit, and each round was averaged over all of them."""
    plan = tmp_path / "plan.json"
    write_trial_plan(plan, replicas, 1, "diloco", inner_steps=5)
    text = plan.read_text().replace('"compression": "none"', '"compression": "int8"')
    plan.write_text(text)
    run = HivemindRun(plan, tmp_path)
    try:
        _start_replicas(run, replicas, 10, "--fake-data")
        codes = run.wait(100)
        logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in range(replicas))
        assert all(c == 0 for c in codes.values()), logs
        for r in range(replicas):
            assert "averaged over replicas" not in run.output(r), logs  # never a partial group
            assert "outer_step 2:" in run.output(r), logs
        models = load_models(tmp_path / "ck", list(range(replicas)), 10)
        assert max_param_diff(models) == 0.0, logs
    finally:
        run.stop()
    assert run.p2pd_left() == []


def _opt_tensors(ck_dir, ranks, step):
    """Each rank's DiLoCo outer model (anchor) and pending pseudo-gradients, flat."""
    from modules.train.checkpoint import load_checkpoint, step_path

    out = []
    for r in ranks:
        opt = load_checkpoint(step_path(ck_dir, r, step), {})["opt"]
        out.append(torch.cat([a.reshape(-1) for a in opt["anchor"]]
                             + [k.reshape(-1) for _, _, k in opt["pending"]]))
    return out


@pytest.mark.timeout(240)
def test_overlap_equals_the_store_backends_overlap(tmp_path):
    """--overlap on, 2 replicas on loopback, int8: the hivemind backend's parameters, outer
    model and pending pseudo-gradient equal the store backend's overlap, bit for bit, for the
    same inputs (every round completes)."""
    plan = tmp_path / "plan.json"
    write_trial_plan(plan, 2, 1, "diloco", inner_steps=5)
    plan.write_text(plan.read_text().replace('"compression": "none"', '"compression": "int8"'))
    got = {}
    for backend in ("store", "hivemind"):
        out = tmp_path / backend
        out.mkdir()
        run = HivemindRun(plan, out, backend=backend)
        try:
            extra = ("--fake-data", "--overlap", "on")
            peers = None if backend == "store" else _start_replicas(run, 1, 20, *extra)
            for r in range(1 if backend == "hivemind" else 0, 2):
                run.start(r, "--steps", "20", "--ckpt-dir", str(out / "ck"), *extra,
                          peers=peers)
            codes = run.wait(150)
            logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in (0, 1))
            assert codes == {0: 0, 1: 0}, (backend, codes, logs)
            assert "running in the background" in run.output(0), logs
            assert "failed" not in run.output(0) + run.output(1), logs  # every round completed
            if backend == "hivemind":  # every round in the roster's group, no matchmaking
                for r in (0, 1):
                    assert "4 rounds averaged here, 4 in the roster's group" in run.output(r), logs
            got[backend] = (load_models(out / "ck", [0, 1], 20),
                            _opt_tensors(out / "ck", [0, 1], 20))
        finally:
            run.stop()
        assert run.p2pd_left() == []
    (store_models, store_opt), (hv_models, hv_opt) = got["store"], got["hivemind"]
    for r in (0, 1):
        assert max_param_diff([store_models[r], hv_models[r]]) == 0.0, r
        assert torch.equal(store_opt[r], hv_opt[r]), r
    assert torch.equal(hv_opt[0][:hv_opt[0].numel() // 2], hv_opt[1][:hv_opt[1].numel() // 2])
    assert max_param_diff(hv_models) > 0  # overlap's merge keeps each replica's local progress


def _two_replicas(out, plan, steps, *extra):
    """Replicas 0 and 1 of `plan` to step `steps` (checkpoints in out/ck), waited for: each
    replica's log."""
    run = HivemindRun(plan, out)
    try:
        _start_replicas(run, 2, steps, "--fake-data", *extra)
        codes = run.wait(150)
        logs = [run.output(r) for r in (0, 1)]
        assert codes == {0: 0, 1: 0}, (codes, [x[-2500:] for x in logs])
    finally:
        run.stop()
    assert run.p2pd_left() == []
    return logs


@pytest.mark.timeout(420)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_resume_over_hivemind_equals_the_run_never_stopped(tmp_path, overlap):
    """2 replicas, int8, H = 5: stopped at step 10 and restarted with --resume to step 20, every
    replica's parameters (and with overlap its outer model and pending pseudo-gradient: the
    round in flight at the stop is re-run) equal those of a run never stopped, bit for bit."""
    plan = tmp_path / "plan.json"
    write_trial_plan(plan, 2, 1, "diloco", inner_steps=5)
    plan.write_text(plan.read_text().replace('"compression": "none"', '"compression": "int8"'))
    extra = ("--overlap", overlap)
    (tmp_path / "once").mkdir()
    (tmp_path / "twice").mkdir()
    _two_replicas(tmp_path / "once", plan, 20, *extra)
    _two_replicas(tmp_path / "twice", plan, 10, *extra)
    logs = _two_replicas(tmp_path / "twice", plan, 20, *extra, "--resume")
    assert all("resumed from step 10" in x for x in logs), [x[-2500:] for x in logs]
    once = load_models(tmp_path / "once" / "ck", [0, 1], 20)
    twice = load_models(tmp_path / "twice" / "ck", [0, 1], 20)
    for r in (0, 1):
        assert max_param_diff([once[r], twice[r]]) == 0.0, (r, [x[-2500:] for x in logs])
    got = [_opt_tensors(tmp_path / run / "ck", [0, 1], 20) for run in ("once", "twice")]
    for r in (0, 1):
        assert torch.equal(got[0][r], got[1][r]), r


@pytest.mark.timeout(300)
def test_a_replica_resumed_from_an_older_checkpoint_takes_the_others_state(tmp_path):
    """Over hivemind there is no store to agree on a common checkpoint: replica 1 lost its
    newest one (step 15) and resumes from step 10 while replica 0 resumes from 15. Replica 0
    declares its resumed rounds at once, so replica 1's first round finds them completed and
    takes replica 0's outer state (as after a failed round); both end bit-identical."""
    plan = tmp_path / "plan.json"
    write_trial_plan(plan, 2, 1, "diloco", inner_steps=5)
    _two_replicas(tmp_path, plan, 15, "--ckpt-every", "5", "--keep-checkpoints", "5")
    (tmp_path / "ck" / "rank1" / "step00000015.pt").unlink()
    logs = _two_replicas(tmp_path, plan, 25, "--resume")
    assert "resumed from step 15" in logs[0] and "resumed from step 10" in logs[1], logs
    assert "took the outer state of a replica that completed it (round 3)" in logs[1], logs[1]
    models = load_models(tmp_path / "ck", [0, 1], 25)
    assert max_param_diff(models) == 0.0, [x[-2500:] for x in logs]


@pytest.mark.timeout(120)
def test_killed_replica_is_dropped(tmp_path):
    """Three replicas; replica 2 is killed (kill -9 of its session) after round 1: once its
    roster entry expired the others average without it and finish bit-identical."""
    run = HivemindRun(_plan(tmp_path, 3, inner_steps=4), tmp_path)
    try:
        _start_replicas(run, 3, 40, "--fake-data", "--heartbeat-timeout-s", "3")
        assert run.wait_for(2, r"outer_step 1:", 90), run.output(2)
        run.kill(2)
        codes = run.wait(90)
        logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in (0, 1))
        assert codes[0] == 0 and codes[1] == 0, (codes, logs)
        assert "replica(s) [2] left the DHT roster" in run.output(0), logs
        assert max_param_diff(load_models(tmp_path / "ck", [0, 1], 40)) == 0.0, logs
    finally:
        run.stop()
    assert run.p2pd_left() == []


@pytest.mark.timeout(150)
def test_overlap_killed_replica_is_dropped_and_outer_models_stay_equal(tmp_path):
    """--overlap on, three replicas; replica 2 is killed (kill -9 of its session) in the middle
    of round 2's inner steps, while round 1's average runs in the background: the survivors
    go on without it and end with the same outer model (and pending pseudo-gradient
    inputs agreed), bit for bit, after the rounds that followed."""
    run = HivemindRun(_plan(tmp_path, 3, inner_steps=4), tmp_path)
    steps = 40
    try:
        _start_replicas(run, 3, steps, "--fake-data", "--heartbeat-timeout-s", "3",
                        "--overlap", "on")
        assert run.wait_for(2, r"step 6/", 90), run.output(2)
        run.kill(2)
        codes = run.wait(120)
        logs = "\n".join(f"[{r}] {run.output(r)[-3000:]}" for r in (0, 1))
        assert codes[0] == 0 and codes[1] == 0, (codes, logs)
        assert "replica(s) [2] left the DHT roster" in run.output(0), logs
        anchors = [t[:t.numel() // 2] for t in _opt_tensors(tmp_path / "ck", [0, 1], steps)]
        assert torch.equal(anchors[0], anchors[1]), logs
    finally:
        run.stop()
    assert run.p2pd_left() == []


@pytest.mark.timeout(660)
def test_late_joiner_loads_state_and_ends_identical(tmp_path):
    """Replicas 0 and 1 start (--replicas 0,1); replica 2 starts with --join while they train:
    it loads the outer model, momentum and round count of a round they completed, takes part
    from the next round and ends bit-identical with them."""
    run = HivemindRun(_plan(tmp_path, 3, inner_steps=4), tmp_path)
    # long enough to outlast the joiner's start: it loaded round 31 of 40 here on a quiet
    # machine and, under load (the suite), came up after the 160 steps were over
    steps = "400"
    try:
        peers = _start_replicas(run, 2, int(steps), "--fake-data", "--replicas", "0,1")
        # started once they completed a round (under load a joiner started earlier may load
        # round 0's state, before any round completed)
        assert run.wait_for(0, r"outer_step 1:", 90), run.output(0)
        run.start(2, "--steps", steps, "--ckpt-dir", str(tmp_path / "ck"), "--fake-data",
                  "--join", peers=peers)
        # 34 s on a quiet machine; the suite's CI had rank 0 at step 119 of 400 after 200 s
        codes = run.wait_progressing(stall_s=90, limit_s=540)
        logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in (0, 1, 2))
        assert codes == {0: 0, 1: 0, 2: 0}, (codes, logs)
        loaded = run.wait_for(2, r"--join: loaded the outer model, momentum and round count "
                              r"(\d+)", 1)
        assert loaded and int(loaded.group(1)) >= 1, logs  # a completed round's state
        assert max_param_diff(load_models(tmp_path / "ck", [0, 1, 2], int(steps))) == 0.0, logs
    finally:
        run.stop()
    assert run.p2pd_left() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_sigterm_stops_a_replica_without_leaving_p2pd(tmp_path, overlap):
    """SIGTERM while training (with --overlap on: while the background thread waits for the
    other replica in round 1): the emergency exit, no traceback, no p2pd left."""
    run = HivemindRun(_plan(tmp_path, 2), tmp_path)
    try:
        # --replicas 0: the start barrier passes; round 1 then waits for the other replica
        run.start(0, "--steps", "1000", "--fake-data", "--overlap", overlap, "--replicas", "0")
        run.peers_of(0)
        started = r"step 1/1000" if overlap == "off" else r"step 7/1000"  # round 1 in flight
        assert run.wait_for(0, started, 40), run.output(0)
        run.procs[0].send_signal(signal.SIGTERM)
        code = run.wait(20)[0]
        assert code == TERM_STATUS, run.output(0)  # the store backend's emergency exit
        assert "stopped by SIGTERM" in run.output(0), run.output(0)
        assert "Traceback" not in run.output(0), run.output(0)
        assert run.p2pd_left() == [], "p2pd outlived its replica"
    finally:
        run.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_ctrl_c_after_the_averager_started_exits_130_without_p2pd(tmp_path, overlap):
    """SIGINT once the averager runs (hivemind's run_in_background sets SIG_IGN for SIGINT in
    the host process; the backend puts Ctrl+C back): exit 130, no traceback, no p2pd left,
    in the start barrier (waiting for the other replica) and in a round (blocking, or in the
    background) that waits for the other replica, frozen with SIGSTOP after it joined (its
    roster entry stays until it expires)."""
    run = HivemindRun(_plan(tmp_path, 2), tmp_path)
    # a test process started in the background ignores SIGINT, and its children inherit that;
    # a handler here is reset to the default in them (what a replica in a terminal has)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run.start(0, "--steps", "1000", "--fake-data", "--overlap", overlap)
        run.peers_of(0)
        assert run.wait_for(0, r"waiting for 2 replicas", 40), run.output(0)
        time.sleep(0.5)
        run.procs[0].send_signal(signal.SIGINT)
        assert run.wait(20)[0] == 130, run.output(0)
        assert "Traceback" not in run.output(0), run.output(0)
        assert run.p2pd_left() == [], "p2pd outlived its replica"
        run.start(0, "--steps", "1000", "--fake-data", "--overlap", overlap)
        run.start(1, "--steps", "1000", "--fake-data", "--overlap", overlap,
                  peers=run.peers_of(0))
        assert run.wait_for(0, r"step 7/1000", 60), run.output(0)  # round 1 reached
        os.killpg(run.procs[1].pid, signal.SIGSTOP)
        time.sleep(1.5)  # replica 0 waits for replica 1 in round 1 or 2
        assert run.procs[0].poll() is None, run.output(0)
        run.procs[0].send_signal(signal.SIGINT)
        assert run.procs[0].wait(timeout=20) == 130, run.output(0)
        # known (docs/hivemind.md, Not done): a DHT call cut by Ctrl+C may leave the forked DHT
        # process an EOFError traceback ("Process DHT-1:"); the rank itself prints none
        assert run.output(0).count("Traceback") == run.output(0).count("\nProcess DHT-"), \
            run.output(0)
        run.kill(1)
        assert run.p2pd_left() == [], "p2pd outlived its replica"
    finally:
        signal.signal(signal.SIGINT, before)
        run.stop()


@pytest.mark.timeout(60)
def test_kill_9_of_the_rank_alone_leaves_no_p2pd(tmp_path):
    """kill -9 of the rank process only (not its session): its DHT process notices, stops its
    p2pd and exits (modules/sync/hivemind_dht.py's orphan guard)."""
    run = HivemindRun(_plan(tmp_path, 2), tmp_path)
    try:
        run.start(0, "--steps", "1000", "--fake-data")
        run.peers_of(0)
        assert run.p2pd_left(grace_s=0) != [], "no p2pd to watch"
        run.procs[0].send_signal(signal.SIGKILL)
        run.procs[0].wait(10)
        assert run.p2pd_left(grace_s=5) == [], "p2pd outlived its rank"
    finally:
        run.stop()


@pytest.mark.timeout(90)
def test_a_replica_alone_in_the_roster_takes_its_rounds_at_once(tmp_path):
    """A one-rank replica alone in the roster (started alone: --min-replicas defaults to 1)
    takes each round as the mean of its own, saying so once, instead of matching for
    --timeout-s and skipping every round (3 rounds would take > 3 x 30 s here)."""
    run = HivemindRun(_plan(tmp_path, 2), tmp_path)
    try:
        t0 = time.monotonic()
        run.start(0, "--steps", "15", "--fake-data", "--replicas", "0", "--timeout-s", "30")
        assert run.wait(80)[0] == 0, run.output(0)
        out, took = run.output(0), time.monotonic() - t0
        assert out.count("alone in the DHT roster") == 1, out
        assert "outer_step 3:" in out and "no completed average" not in out, out
        assert took < 40, (took, out)
    finally:
        run.stop()


def test_allreduce_refused_by_name():
    """--outer-backend hivemind on a plan in sync mode allreduce exits 2 naming the flag."""
    from formats.plan import plan_from_dict
    from modules.config import HivemindConfig, RunConfig
    from testkit.fuzz import plan_dict

    hv = RunConfig(steps=4, hivemind=HivemindConfig(outer_backend="hivemind"))
    with pytest.raises(UserError, match="--outer-backend hivemind: needs sync mode diloco"):
        hv.resolve(plan_from_dict(plan_dict("allreduce")))


@pytest.mark.timeout(300)
def test_shard_groups_average_shard_by_shard_as_the_store_backend(tmp_path):
    """2 replicas x D = 2 (FSDP2 inside each replica, on its own store), int8, H = 5: device i
    of each replica averages its shard with device i of the other replica in rounds of its own
    (averager and roster keyed by stage and shard). Every rank's checkpoint equals the store
    backend's, bit for bit, and shard i is the same in both replicas."""
    from formats.plan import Plan, SyncConfig, save_plan
    from modules.train.checkpoint import load_checkpoint, step_path

    plan = tmp_path / "plan.json"
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[[0, 1]], [[2, 3]]], micro_batch_size=2,
                   num_micro_batches=1, sync=SyncConfig("diloco", 5, "int8")), plan)
    got = {}
    for backend in ("store", "hivemind"):
        out = tmp_path / backend
        out.mkdir()
        run = HivemindRun(plan, out, ranks_per_replica=2, backend=backend)
        try:
            common = ("--steps", "10", "--ckpt-dir", str(out / "ck"), "--fake-data")
            peers = None
            for r in range(4):
                run.start(r, *common, peers=peers)
                if backend == "hivemind" and r == 0:
                    peers = run.peers_of(0)
            codes = run.wait(200)
            logs = "\n".join(f"[{r}] {run.output(r)[-2000:]}" for r in range(4))
            assert codes == {r: 0 for r in range(4)}, (backend, logs)
            if backend == "hivemind":
                for r in range(4):
                    assert f"hivemind outer sync of stage 0 shard {r % 2}:" in run.output(r), logs
                    assert "2 rounds averaged here" in run.output(r), logs
            got[backend] = [load_checkpoint(step_path(out / "ck", r, 10),
                                            {"shard_degree": 2})["model"] for r in range(4)]
        finally:
            run.stop()
        assert run.p2pd_left() == []
    for r in range(4):
        assert max_param_diff([got["store"][r], got["hivemind"][r]]) == 0.0, r
    for a, b in ((0, 2), (1, 3)):  # shard i of both replicas
        assert max_param_diff([got["hivemind"][a], got["hivemind"][b]]) == 0.0, (a, b)


@pytest.mark.timeout(660)
def test_a_sharded_late_joiner_loads_every_shard_and_ends_identical(tmp_path):
    """Replicas 0 and 1 of 2 x D = 2 start; replica 2 (two ranks) starts with --join while they
    train: each of its shards loads the state of its shard's rounds from a peer, the replica
    agrees on one step, and every shard ends bit-identical with the same shard of the other
    replicas. (Refused until 2026-11-27: see docs/hivemind.md.)"""
    from formats.plan import Plan, SyncConfig, save_plan
    from modules.train.checkpoint import load_checkpoint, step_path

    plan = tmp_path / "plan.json"
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[[0, 1]], [[2, 3]], [[4, 5]]],
                   micro_batch_size=2, num_micro_batches=1,
                   sync=SyncConfig("diloco", 4, "int8")), plan)
    run = HivemindRun(plan, tmp_path, ranks_per_replica=2)
    steps = "240"  # 60 rounds: the joiner started at round 31-33 on a quiet machine
    common = ("--steps", steps, "--ckpt-dir", str(tmp_path / "ck"), "--fake-data")
    try:
        peers = None
        for r in range(4):
            run.start(r, *common, "--replicas", "0,1", peers=peers)
            peers = peers or run.peers_of(0)
        assert run.wait_for(0, r"outer_step 1:", 120), run.output(0)
        for r in (4, 5):
            run.start(r, *common, "--join", peers=peers)
        codes = run.wait_progressing(stall_s=90, limit_s=480)
        logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in range(6))
        assert codes == {r: 0 for r in range(6)}, (codes, logs)
        for r in (4, 5):
            assert re.search(rf"--join: loaded the outer model, momentum and round count \d+ "
                             rf"of stage 0 shard {r % 2}", run.output(r)), logs
        got = [load_checkpoint(step_path(tmp_path / "ck", r, int(steps)),
                               {"shard_degree": 2})["model"] for r in range(6)]
        for shard in (0, 1):
            assert max_param_diff(got[shard::2]) == 0.0, (shard, logs)
    finally:
        run.stop()
    assert run.p2pd_left() == []


def test_a_matched_group_of_mixed_rounds_is_refused():
    """A matchmaking group whose members were at different rounds (a joiner's averager still
    matching the round its host gave up on) is refused, on every member alike."""
    from modules.sync.hivemind_outer import same_round

    assert same_round({b"a": _g(0, 32), b"b": _g(2, 32)},
                      32) == [0, 2]
    with pytest.raises(PeerError, match=r"mixed rounds \[32, 33\]; its average is not applied"):
        same_round({b"a": _g(1, 32), b"b": _g(2, 31)}, 32)


def test_fragments_refused_by_name_and_overlap_accepted():
    """--fragments > 1 is refused by its own flag (exit 2 before anything starts), with what to
    pass instead; --overlap on runs (the rounds in the background, BackgroundRounds)."""
    from formats.plan import plan_from_dict
    from modules.config import HivemindConfig, RunConfig
    from testkit.fuzz import plan_dict

    hv = RunConfig(steps=4, hivemind=HivemindConfig(outer_backend="hivemind"))
    fragmented = plan_dict("diloco")
    fragmented["sync"].update(fragments=2)
    with pytest.raises(UserError, match=r"^--fragments 2: .*pass --fragments 1"):
        hv.resolve(plan_from_dict(fragmented))
    overlapped = plan_dict("diloco")
    overlapped["sync"].update(overlap=True)
    assert hv.resolve(plan_from_dict(overlapped)).overlapped


def test_background_round_nobody_completed_is_skipped_at_the_boundary():
    """Overlap over hivemind: a background round that nobody completed (the attempt returns
    None) is not redone; at the next boundary DiLoCo applies no outer step (the anchor stays,
    the parameters keep their local progress) and the next pseudo-gradient carries both
    rounds' drift; a round that completed is applied as with the store backend."""
    from modules.sync.hivemind_outer import BackgroundRounds

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    sent = []

    def attempt(flat, index):
        sent.append(flat.clone())
        return None if index == 0 else 1  # round 0 failed everywhere, round 1 completed

    rounds = BackgroundRounds(attempt, lambda: None)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DiLoCoOptimizer(model.parameters(), inner, inner_steps=1, overlap=True,
                          reducer=rounds)
    anchor0 = [a.clone() for a in opt.anchor]
    for _ in range(2):  # boundary 1 launches round 0; boundary 2 collects it (skipped)
        opt.zero_grad()
        model(torch.ones(4)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.anchor, anchor0))  # no outer step
    # no merge either: the parameters are the inner step's, nothing else
    assert all(torch.equal(p, b.add(p.grad, alpha=-0.1))
               for p, b in zip(model.parameters(), before))
    pseudo = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor0,
                                                                    model.parameters())])
    opt.zero_grad()
    model(torch.ones(4)).sum().backward()
    opt.step()  # boundary 3 collects round 1 (the worker has run it): applied
    assert torch.equal(sent[1], pseudo)  # round 1 sent both rounds' drift
    assert not all(torch.equal(a, b) for a, b in zip(opt.anchor, anchor0))
    rounds.drain()
    rounds.close()


async def _peers_of(dht, node) -> list[str]:
    return [str(p.peer_id) for p in await node.p2p.list_peers()]


@pytest.mark.timeout(90)
def test_roster_connects_to_every_replica_at_its_announced_addresses():
    """Reading the roster connects my p2pd to each replica at the addresses its entry
    carries (on the namespace lab libp2p's routing alone did not, and groups never
    formed there); an entry whose addresses do not answer is named in a
    warning, once; a --client-mode replica announces no address (nobody dials it)."""
    from modules.sync.hivemind_dht import Roster

    a = start_dht([], ["/ip4/127.0.0.1/tcp/0"], [], False, 60)
    b = start_dht(visible_maddrs(a), ["/ip4/127.0.0.1/tcp/0"], [], False, 60)
    lines: list[str] = []
    roster = Roster(a, "rt", 0, 0, 30.0, log=lines.append)
    try:
        roster._link([[str(b.peer_id), visible_maddrs(b)]])
        assert lines == []
        assert str(b.peer_id) in a.run_coroutine(_peers_of)
        b.shutdown()
        dead = "12D3KooWSjtLceP4PpkctnkcgjdXoGBmC2skoLb12ybijWGAF3EB"
        for _ in range(2):
            roster._link([[dead, ["/ip4/127.0.0.1/tcp/1"]]])
        assert len(lines) == 1 and f"could not connect to replica peer {dead}" in lines[0], lines
        assert roster.maddrs and Roster(a, "rt", 0, 1, 30.0, client_mode=True).maddrs == []
    finally:
        roster.close()
        for d in (a, b):
            d.shutdown()


def _entries(**replicas):
    """A DHT dictionary value: replica -> (roster entry of a --client-mode peer, expiration)."""
    from hivemind.utils import ValueWithExpiration

    return ValueWithExpiration({int(r[1:]): ValueWithExpiration([peer, [], ""], exp)
                                for r, (peer, exp) in replicas.items()}, max(
                                    (e for _, e in replicas.values()), default=0.0))


def test_roster_keeps_an_entry_until_it_expires(monkeypatch):
    """A DHT read that comes back empty or partial (a lookup that timed out under load) does
    not drop a replica whose entry has not expired; an expired one is dropped."""
    import hivemind.utils

    from modules.sync.hivemind_dht import Roster

    now = [1000.0]
    monkeypatch.setattr(hivemind.utils, "get_dht_time", lambda: now[0])
    dht = FakeDHT()
    roster = Roster(dht, "rt", 0, 0, 3.0, log=print, client_mode=True)
    key = "rt_roster_s0"
    dht.answers[key] = _entries(r0=(FAKE_ID, 1003.0), r1=(PEER_B, 1003.0), r2=(PEER_C, 1002.0))
    assert roster.live() == {0, 1, 2} and roster.peers() == {PEER_B, PEER_C}
    dht.answers[key] = None  # a read that found nothing
    assert roster.live() == {0, 1, 2}
    now[0] = 1002.5  # replica 2's entry expired, and the read misses replica 1 (not expired)
    dht.answers[key] = _entries(r0=(FAKE_ID, 1005.5))
    assert roster.live() == {0, 1} and roster.peers() == {PEER_B}
    now[0] = 1004.0
    assert roster.live() == {0}


PEER_B = "12D3KooWSjtLceP4PpkctnkcgjdXoGBmC2skoLb12ybijWGAF3EB"
PEER_C = "12D3KooWEc18wRzA5EdjBmbApgEM78K2VMS3nWa4N523d64XHEph"


class _FakeAverager:
    """The averager's surface _recover_background uses: its prefix, peer id and the state a
    peer shares (`shared`: (meta, tensors) or None)."""

    prefix = "run_s0"

    def __init__(self, dht) -> None:
        self.peer_id, self.shared, self.loads = dht.peer_id, None, 0

    def load_checked_state(self, check, peers, timeout):
        from modules.sync.hivemind_checks import state_fault

        self.loads += 1
        if self.shared is None:
            return None, [], []
        fault = state_fault(*self.shared, **check)
        return (*self.shared, []) if fault is None else (None, [], [(peers[0], fault)])


def _background_outer(declared: dict[str, float], live: list[str], averaging_s: float):
    """A HivemindOuter on fakes, after a failed background round: `declared`: peer -> the
    rounds it declared done; `live`: the peers in the roster (besides me, replica 0)."""
    from hivemind.p2p import PeerID
    from hivemind.utils import ValueWithExpiration

    from modules.sync.hivemind_auth import PeerProof
    from modules.sync.hivemind_outer import HivemindOuter, HivemindSettings
    from modules.sync.outer_deadlines import OuterDeadlines

    hv = HivemindOuter.__new__(HivemindOuter)
    hv.cfg = HivemindSettings((), (), (), False, "run", 30.0, 3.0, 2, 3, "none", None, None)
    hv.deadlines = OuterDeadlines(0.5, averaging_s, None, "test")
    hv.stage, hv.replica, hv.background, hv.completed = 0, 0, True, 0
    hv.what, hv.identity, hv.numel = "stage 0", "", 4
    hv.results, hv.lock, hv.lines = {}, threading.Lock(), []
    hv.closing, hv.whole, hv.catching_up = threading.Event(), True, False
    hv.log = hv.lines.append
    hv.offenders = Offenders(hv.what, hv.log)
    hv.dht = FakeDHT()
    hv.proof = PeerProof(b"test secret", "run")
    hv.averager = _FakeAverager(hv.dht)
    hv.dht.answers["run_s0.all_averagers"] = ValueWithExpiration(
        {PeerID.from_base58(p).to_bytes(): ValueWithExpiration(v, 2e9)
         for p, v in declared.items()}, 2e9)

    class Roster:
        def live(self, max_age_s=0.0):
            return {0} | {i + 1 for i in range(len(live))}

        def peers(self, sharing=False):
            return set(live)

        def trusted(self):  # every peer that declared was a member
            return set(declared)

        unproven: set = set()

    hv.roster = Roster()
    return hv


def test_background_round_completed_only_by_a_dead_replica_is_skipped():
    """Overlap: round 3 (index 2) failed here; the only replica that declared it done is no
    longer in the roster (it completed the round and was killed): the survivors skip it once
    no live replica declared it for the averaging deadline, rather than waiting --timeout-s
    for an average nobody alive has and stopping."""
    hv = _background_outer({PEER_C: 3.0, PEER_B: 2.0}, [PEER_B], averaging_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(OuterRoundSkipped):
        hv._recover_background(torch.zeros(4), 2)
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert hv.averager.loads == 0 and "failed on every live replica" in hv.lines[-1], hv.lines


def test_background_round_completed_by_a_live_replica_takes_its_average():
    """Overlap: a live replica declared round 3 done and shares its average: it is copied into
    the job's tensor (0 bytes sent), and this replica declares the round done in turn."""
    hv = _background_outer({PEER_B: 3.0}, [PEER_B], averaging_s=1.0)
    average = torch.arange(4.0)
    hv.averager.shared = ({"run": "run", "identity": "", "outer_count": 3, "completed": 3,
                           "results": [1, 2]},
                          [torch.zeros(4), torch.zeros(0), torch.ones(4), average])
    hv.averager.state_sharing_priority = 0.0
    flat = torch.zeros(4)
    assert hv._recover_background(flat, 2) == 0
    assert torch.equal(flat, average) and hv.completed == 3
    assert hv.averager.state_sharing_priority == 3.0 and torch.equal(hv.results[2], average)


def test_background_round_whose_average_is_gone_stops_at_once_naming_the_cause():
    """Overlap: the replica that completed round 2 keeps no average of it (it resumed from a
    newer checkpoint than this replica's, so it keeps none from before; or it is two rounds
    ahead): this replica cannot catch up and says so at once, naming the fix, rather than
    waiting --timeout-s for an average nobody holds."""
    hv = _background_outer({PEER_B: 3.0}, [PEER_B], averaging_s=1.0)
    for kept in ([], [3, 4]):
        hv.averager.shared = ({"run": "run", "identity": "", "outer_count": 4,
                               "completed": 4, "results": kept},
                              [torch.zeros(4), torch.zeros(0)] + [torch.ones(4)] * len(kept))
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="resume every replica from the same step"):
            hv._recover_background(torch.zeros(4), 1)
        assert time.monotonic() - t0 < 5.0 and hv.completed == 0


class _Step:
    """A matchmaking step's control (hivemind's StepControl): its result after `polls`
    timed-out waits of the caller."""

    def __init__(self, value, polls: int = 0) -> None:
        self.value, self.polls, self.cancelled = value, polls, False

    def result(self, timeout=None):
        if self.polls:
            self.polls -= 1
            time.sleep(0.01)  # a short stand-in for the caller's timeout
            raise TimeoutError
        return self.value

    def cancel(self):
        self.cancelled = True


def test_a_replica_stops_matching_a_round_the_others_completed():
    """A replica whose side of a round failed stops matchmaking as soon as a live replica
    declared the round done (it then takes the round from it), not after the deadline."""
    hv = _background_outer({PEER_B: 6.0}, [PEER_B], averaging_s=1.0)
    step = _Step(None, polls=1000)
    with pytest.raises(PeerError, match="completed it without me"):
        hv._matched(5, step)
    assert step.cancelled and step.polls == 999
    hv = _background_outer({PEER_B: 5.0}, [PEER_B], averaging_s=1.0)  # round 5 not done yet
    hv.live, hv.guard = set(), SplitGuard(2, 5.0, [], hv.log)
    assert hv._matched(5, _Step("avg", polls=2)) == "avg"


def test_every_attempt_of_a_round_uses_the_rounds_group_key():
    """hivemind moves a peer's group bits on when a group is assembled (each member to other
    bits), so an attempt that assembled a group and then failed (a replica killed in it) left
    the survivors on different keys: each attempt sets the round's bits again, and hivemind
    does not retry inside a step (its retries would use the moved bits)."""
    hv = _background_outer({}, [PEER_B], averaging_s=1.0)
    hv.live, hv.guard = set(), SplitGuard(2, 5.0, [], hv.log)
    hv._set_group_size = lambda size, minimum: None
    calls = []

    def set_group_bits(bits):
        hv.averager.bits = bits

    def step(gather, weight, timeout, allow_retries=True, wait=True):
        calls.append((hv.averager.bits, allow_retries))
        if len(calls) == 2:  # assembled, then a member died mid-way: hivemind moved the bits
            hv.averager.bits = "1" + hv.averager.bits[1:]
            raise RuntimeError("a peer left the round mid-way")
        assert hv.averager.bits == format(5, "016b"), "the survivors would never meet"
        return _Step({b"a": _g(0, 5), b"b": _g(1, 5)})

    def roster_group(index, live, weight):  # the first attempt: a member died in it
        calls.append(("roster's group", index))
        raise RuntimeError("a peer left the round mid-way")

    hv.averager.set_group_bits, hv.averager.step = set_group_bits, step
    hv._fixed, hv._reach, hv.last_group = roster_group, lambda index: None, {0, 1}
    assert hv._round(5, 1.0) == [0, 1]
    assert calls == [("roster's group", 5)] + [(format(5, "016b"), False)] * 2, calls


def test_a_round_starts_in_the_rosters_group_without_matchmaking():
    """The first attempt of a round is the roster's group (read at most half a heartbeat
    ago) when the roster is the last round's group: no matchmaking step runs. When the roster
    changed (a replica joined, or one that left is still listed), matchmaking at once."""
    hv = _background_outer({}, [PEER_B], averaging_s=1.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(2, 5.0, [], hv.log), {0, 1}
    ages, calls, steps = [], [], []
    hv.roster.live = lambda max_age_s=0.0: ages.append(max_age_s) or {0, 1}
    hv._fixed = lambda index, live, weight: calls.append((index, live, weight)) or [0, 1]
    hv.averager.step = lambda **kw: pytest.fail("matchmaking ran")
    assert hv._round(7, 1.0) == [0, 1]
    assert calls == [(7, {0, 1}, 1.0)] and ages == [hv.cfg.heartbeat_s / 2]

    hv.last_group = {0, 1, 2}  # replica 2 left: its entry has expired, the roster changed
    hv._set_group_size, hv._reach = (lambda size, minimum: None), (lambda index: None)
    hv.averager.set_group_bits = lambda bits: None
    hv.averager.step = lambda **kw: steps.append(kw["gather"]) or _Step(
        {b"a": _g(0, 8), b"b": _g(1, 8)})
    assert hv._round(8, 1.0) == [0, 1]
    mine = {**_g(0, 8), "proof": hv.proof.of(str(hv.dht.peer_id))}  # a member's gather
    assert len(calls) == 1 and steps == [mine]


def test_roster_members_are_the_same_group_on_every_replica(monkeypatch):
    """Two replicas reading the same roster form the same members in replica order, each
    with its --client-mode flag (no announced address); a fresh read is skipped when the last
    one is younger than max_age_s."""
    import hivemind.utils
    from hivemind.utils import ValueWithExpiration

    from modules.sync.hivemind_dht import Roster

    monkeypatch.setattr(hivemind.utils, "get_dht_time", lambda: 1000.0)
    entries = {0: [FAKE_ID, ["/ip4/1.2.3.4/tcp/1"], ""], 1: [PEER_B, [], ""],
               2: [PEER_C, ["/ip4/1.2.3.5/tcp/1"], ""]}
    value = ValueWithExpiration({r: ValueWithExpiration(e, 1003.0) for r, e in entries.items()},
                                1003.0)
    groups = []
    for me, peer in ((0, FAKE_ID), (2, PEER_C)):
        dht = FakeDHT(peer)
        dht.answers["rt_roster_s0"] = value
        roster = Roster(dht, "rt", 0, me, 3.0, log=print, client_mode=True)
        roster._link = lambda entries: None
        live = roster.live()
        groups.append(roster.members(live, peer, client_mode=False))
        dht.answers["rt_roster_s0"] = None  # a read now would find nothing: not read
        assert roster.live(max_age_s=60.0) == {0, 1, 2}
    assert groups[0] == groups[1] == [(FAKE_ID, 0, False), (PEER_B, 1, True),
                                      (PEER_C, 2, False)]


def test_a_replica_lingers_until_the_others_declared_its_last_round():
    """After the last step a replica stays (sharing) until every live sharing replica declared
    the rounds it completed: a peer whose side of the last round failed takes it from it
    meanwhile; bounded (matchmaking + 2 x averaging deadline) when one never does."""
    from hivemind.p2p import PeerID
    from hivemind.utils import ValueWithExpiration

    hv = _background_outer({PEER_B: 2.0}, [PEER_B], averaging_s=1.0)
    hv.completed = 3
    polls = []
    live = hv.roster.live

    def live_then_b_catches_up():
        polls.append(1)
        if len(polls) == 3:  # B took round 3 from me and declared it
            hv.dht.answers["run_s0.all_averagers"] = ValueWithExpiration(
                {PeerID.from_base58(PEER_B).to_bytes(): ValueWithExpiration(3.0, 2e9)}, 2e9)
        return live()

    hv.roster.live = live_then_b_catches_up
    t0 = time.monotonic()
    hv.linger()
    assert len(polls) == 3 and time.monotonic() - t0 < 2.0 and hv.lines == [], hv.lines
    hv = _background_outer({PEER_B: 2.0}, [PEER_B], averaging_s=1.0)
    hv.completed = 3
    t0 = time.monotonic()
    hv.linger()  # B never declares round 3: leave after 0.5 + 2 x 1.0 s, saying so
    assert 2.4 < time.monotonic() - t0 < 5.0
    assert f"leaving before replica peer(s) ['{PEER_B}'] declared round 3" in hv.lines[-1]


def test_a_background_round_cut_by_close_ends_quietly():
    """Ctrl+C while a round runs on the background thread: `close` stops the averager and DHT
    under it, and whatever they raise then (here "handle is closed") ends the round with
    BackendClosed, without a log line blaming the deadlines and without the recovery that
    asks the stopped DHT (which raised in the worker thread and printed a traceback, seen in
    CI); the worker thread stays alive and the error waits for the training thread."""
    from modules.sync.hivemind_outer import BackendClosed, BackgroundRounds, background_attempt

    hv = _background_outer({}, [PEER_B], averaging_s=1.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(2, 5.0, [], hv.log), {0, 1}
    hv.started, hv.shard = True, 0
    hv.averager.get_tensors = lambda: contextlib.nullcontext([torch.zeros(4)])

    def roster_group(index, live, weight):
        hv.closing.set()  # close() ran on the training thread meanwhile
        raise OSError("handle is closed")

    hv._fixed = roster_group
    hv._best_peer_rounds = lambda live_only=False: pytest.fail("asked the stopped DHT")
    rounds = BackgroundRounds(background_attempt(hv, None), lambda: None)
    job = rounds.launch(torch.zeros(4), 0)
    with pytest.raises(BackendClosed, match="round 1 of stage 0 stopped"):
        rounds.finish(job)
    assert hv.lines == [] and rounds.worker.is_alive()
    hv.all_reduce = lambda flat, index: 7  # the worker still takes jobs
    assert rounds.finish(rounds.launch(torch.zeros(4), 1)) is None
    rounds.close()


def test_the_other_parts_of_a_replica_wait_as_long_as_a_round_can_take():
    """`longest_wait_s` (how long a replica's parts wait for each other to agree on the step
    after a round) covers one part's worst round: attempts until --timeout-s, one more,
    then the recovery's wait and download, or a background fetch until --timeout-s again; and
    --join's attempts. With --timeout-s 30, matchmaking 0.5 s, averaging 4 s: 2 x 30 + 0.5 +
    4 + 5 + 2 x 4 + a download from up to 2 peers (2 x 4 + 1) = 86.5 s, where the
    communicator alone would give up after 30 s."""
    hv = _background_outer({}, [], averaging_s=4.0)
    assert hv.longest_wait_s == pytest.approx(86.5)
    assert hv.longest_wait_s > 2 * hv.cfg.timeout_s
    hv.deadlines = None  # before attach: nothing derived yet, the run's timeout
    assert hv.longest_wait_s == hv.cfg.timeout_s


def test_deadlines_widen_after_failed_attempts_and_narrow_back():
    """A failed attempt doubles both deadlines (and the request timeout) up to 8x, or as far
    as one attempt fits --timeout-s; a completed round narrows them one step only when it took
    under half of what the narrower ones allow (so a loaded host does not fail every other
    round). Floors 5 + 10 s with --timeout-s 60: at most 4x."""
    from modules.sync.outer_deadlines import derive

    d = derive(None, None, 0, 1000, "int8", timeout_s=60.0)  # no cluster: floors, no plan read
    assert (d.matchmaking_s, d.averaging_s, d.request_s, d.max_widen) == (5.0, 10.0, 2.5, 4.0)
    w1 = d.widened()
    assert (w1.matchmaking_s, w1.averaging_s, w1.request_s, w1.widen) == (10.0, 20.0, 5.0, 2.0)
    w2 = w1.widened()
    assert (w2.matchmaking_s, w2.averaging_s, w2.widen) == (20.0, 40.0, 4.0)
    assert w2.widened() == w2 and d.widest == w2  # 4 x 15 s = --timeout-s
    assert w2.narrowed(16.0) == w2  # 16 s is not under half of 10 + 20
    assert w2.narrowed(14.0) == w1 and w1.narrowed(7.0) == d and d.narrowed(0.1) == d
    assert derive(None, None, 0, 1000, "int8", timeout_s=600.0).max_widen == 8.0
    assert derive(None, None, 0, 1000, "int8", timeout_s=10.0).max_widen == 1.0
    assert derive(None, None, 0, 1000, "int8").widened().widen == 1.0  # no --timeout-s given
    assert "widened up to 4x when an attempt misses them" in d.describe()


def test_a_failed_attempt_widens_the_next_attempts_deadlines():
    """The round's second attempt (matchmaking) gets the doubled deadlines as its step
    timeout, the averager's process is told (`_set_deadlines`), the log says why; the round
    that then completed quickly narrows them back."""
    from modules.sync.outer_deadlines import OuterDeadlines

    hv = _background_outer({}, [PEER_B], averaging_s=1.0)
    hv.deadlines = OuterDeadlines(0.5, 1.0, None, "test", max_widen=4.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(2, 5.0, [], hv.log), {0, 1}
    hv._set_group_size, hv._reach = (lambda size, minimum: None), (lambda index: None)
    hv.averager.set_group_bits = lambda bits: None
    hv.averager.matchmaking_kwargs = {}
    sent, timeouts = [], []

    class Pipe:
        def send(self, message):
            sent.append(message[2]["matchmaking_s"])
            message[2]["future"].set_result(None)

    hv.averager._outer_pipe = Pipe()

    def roster_group(index, live, weight):
        time.sleep(0.5)  # waited out the matchmaking deadline (a slow member)
        raise RuntimeError("a peer left the round mid-way")

    def step(timeout, **kw):
        timeouts.append(timeout)
        return _Step({b"a": _g(0, 3), b"b": _g(1, 3)})

    hv._fixed, hv.averager.step = roster_group, step
    assert hv._round(3, 1.0) == [0, 1]
    assert timeouts == [3.0] and sent == [1.0] and hv.deadlines.widen == 2.0
    assert hv.averager.matchmaking_kwargs == {"min_matchmaking_time": 1.0}
    assert "deadlines widened after a failed attempt to 1.00 s matchmaking + 2.00 s" in hv.lines[-1]
    hv.rounds_s, hv.plan = [], type("P", (), {"num_replicas": 2})()
    hv._completed = lambda index, flat: None

    @contextlib.contextmanager
    def tensors():
        yield [torch.ones(4)]

    hv.averager.get_tensors = tensors
    hv._averaged(torch.zeros(4), 3, [0, 1], time.monotonic())
    assert hv.deadlines.widen == 1.0 and sent == [1.0, 0.5] and "narrowed" in hv.lines[-1]


@pytest.mark.timeout(120)
@contextlib.contextmanager
def _two_real_averagers(prefix: str, matchmaking_s: float, request_s: float):
    """Two ExactAveragers on loopback DHTs aiming at a group of 3 (at least 2), each holding
    8 copies of its index; shut down after."""
    first = start_dht([], LOOP, [], False, 30)
    dhts = [first, start_dht(visible_maddrs(first), LOOP, [], False, 30)]
    avs = [ExactAverager([torch.full((8,), float(i))], d, wire=CodecWire("none"), start=True,
                         prefix=prefix, target_group_size=3, min_group_size=2,
                         min_matchmaking_time=matchmaking_s, request_timeout=request_s)
           for i, d in enumerate(dhts)]
    try:
        yield avs
    finally:
        for a in avs:
            a.shutdown()
        for d in dhts:
            d.shutdown()


def _in_averagers(avs, method: str, **kwargs) -> None:
    """Run `method` in each averager's process, as HivemindOuter._in_averager does."""
    from hivemind.utils.mpfuture import MPFuture

    for a in avs:
        future = MPFuture()
        a._outer_pipe.send((method, [], {**kwargs, "future": future}))
        future.result(timeout=30)


def _round_of(avs, timeout_s: float) -> tuple[float, list[str]]:
    """One step of every averager at once: the seconds it took and the errors raised."""
    t0, errors = time.monotonic(), []

    def go(i):
        try:
            avs[i].step(gather={"replica": i}, allow_retries=False, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - returned
            errors.append(repr(e))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(avs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return time.monotonic() - t0, errors


def test_widened_deadlines_reach_the_averagers_process():
    """Two real averagers aiming at a group of 3: their group forms with the 2 at the
    matchmaking deadline, ~1 s; after `_set_deadlines` to 4 s it forms at ~4 s (the
    averager's process matches with what it was told, not what it was built with)."""
    with _two_real_averagers("widen", 1.0, 0.5) as avs:
        took, errors = _round_of(avs, 30)
        assert not errors and took < 2.5, (took, errors)
        _in_averagers(avs, "_set_deadlines", matchmaking_s=4.0, averaging_s=10.0, request_s=1.0)
        for a in avs:
            a.matchmaking_kwargs["min_matchmaking_time"] = 4.0
        took, errors = _round_of(avs, 30)
        if errors and all("could not find a group" in e for e in errors):
            # seen once in a full suite run (7 of 7 alone passed): the two missed each other
            # in matchmaking; the next attempt still shows which deadline the process holds
            took, errors = _round_of(avs, 30)
        assert not errors and 3.8 < took < 6.5, (took, errors)


def test_a_minimum_group_size_reaches_the_averagers_process():
    """Two real averagers told (`_set_group_size`) to form groups of at least 3 form none at
    their matchmaking deadline (both steps fail at the step's timeout); told at least 2, they
    form the pair (what a redo after a failed attempt relies on: `HivemindOuter._round`)."""
    with _two_real_averagers("minimum", 0.5, 0.3) as avs:
        _in_averagers(avs, "_set_group_size", size=3, minimum=3)
        assert len(_round_of(avs, 3.0)[1]) == 2
        _in_averagers(avs, "_set_group_size", size=3, minimum=2)
        assert _round_of(avs, 3.0)[1] == []
        assert torch.equal(avs[0]._averaged_tensors[0], torch.full((8,), 0.5))


def test_a_part_behind_its_replica_takes_a_later_rounds_state(monkeypatch):
    """After a round (or --join), a part of a replica whose sibling took a later round's state
    takes the state of a round at or after the replica's furthest step from its peers before
    training on (`Trainer._in_phase`); parts that cannot agree in PHASE_ATTEMPTS tries stop
    the replica rather than train on different outer states."""
    import modules.train.phase as phase_mod
    import modules.train.trainer as trainer_mod

    trainer = trainer_mod.Trainer.__new__(trainer_mod.Trainer)
    trainer.hivemind = type("H", (), {"longest_wait_s": 1.0})()
    trainer.groups = type("G", (), {"world": type("W", (), {"size": 2})()})()
    trainer.state_lock = threading.Lock()
    caught = []

    class Outer:
        def catch_up(self, step, agreed):
            caught.append((step, agreed))
            return 124 if ok else step

    trainer.outer = Outer()
    ranges = iter([(120, 124), (124, 124)])
    monkeypatch.setattr(phase_mod, "agree_range", lambda comm, v, what, t: next(ranges))
    ok = True
    assert trainer._in_phase(120) == 124 and caught == [(120, 124)]
    caught.clear()
    monkeypatch.setattr(phase_mod, "agree_range", lambda comm, v, what, t: (120, 124))
    ok = False
    with pytest.raises(PeerError, match="stayed at steps 120 to 124 after 5 tries"):
        trainer._in_phase(120)
    assert caught == [(120, 124)] * phase_mod.PHASE_ATTEMPTS
    ranges = iter([(124, 128), (128, 128)])  # the sibling behind: this part waits for it
    monkeypatch.setattr(phase_mod, "agree_range", lambda comm, v, what, t: next(ranges))
    caught.clear()
    assert trainer._in_phase(128) == 128 and caught == []


def test_after_a_failed_roster_group_only_every_live_replica_may_redo_the_round():
    """The roster's group failed here; a member may have completed it. The next attempts need
    every live replica in their group (hivemind's min group size = the roster), so two members
    whose sides failed cannot complete the round among themselves apart from the completer:
    they match until it declares the round done, then take it from it (`_recover`)."""
    hv = _background_outer({}, [PEER_B, PEER_C], averaging_s=1.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(3, 5.0, [], hv.log), {0, 1, 2}
    t0, sizes = time.monotonic(), []
    hv._best_peer_rounds = lambda live_only=False: 7.0 if time.monotonic() - t0 > 0.8 else -1.0
    hv._set_group_size, hv._reach = (lambda size, minimum: sizes.append((size, minimum))), (
        lambda index: None)
    hv.averager.set_group_bits = lambda bits: None
    step = _Step(None, polls=1000)  # no group of all three forms: the completer has moved on

    def roster_group(index, live, weight):
        raise RuntimeError("a peer left the round mid-way")

    hv._fixed, hv.averager.step = roster_group, lambda **kw: step
    assert hv._round(6, 1.0) is None  # taken from the completer
    assert sizes == [(3, 3)] and step.cancelled
    assert 0.8 < time.monotonic() - t0 < 2.5


def test_a_first_matchmaking_attempt_may_leave_a_late_replica_out_a_redo_may_not():
    """The roster changed (no roster's group): the round's first matchmaking attempt forms at
    its deadline with whoever came (min group size 2, as hivemind does: a replica still
    starting is not waited for). Once an attempt failed, every later one needs every live
    replica."""
    hv = _background_outer({}, [PEER_B, PEER_C], averaging_s=1.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(3, 5.0, [], hv.log), {0, 1}
    sizes, attempts = [], []
    hv._set_group_size, hv._reach = (lambda size, minimum: sizes.append((size, minimum))), (
        lambda index: None)
    hv.averager.set_group_bits = lambda bits: None
    hv._best_peer_rounds = lambda live_only=False: -1.0

    def step(**kw):
        attempts.append(kw["timeout"])
        if len(attempts) == 1:
            raise RuntimeError("a peer left the round mid-way")
        return _Step({b"a": _g(0, 2), b"b": _g(1, 2),
                      b"c": _g(2, 2)})

    hv._fixed = lambda index, live, weight: pytest.fail("the roster changed: no roster's group")
    hv.averager.step = step
    assert hv._round(2, 1.0) == [0, 1, 2]
    assert sizes == [(3, 2), (3, 3)], sizes


def test_a_redo_waiting_for_every_live_replica_drops_one_that_died():
    """A strict attempt (after a failure) waits for every live replica; one killed mid-round
    stays in the roster until its entry expires. Once it has, the attempt is given up at once
    (not at its deadline, and no widening: no deadline's fault) and the next needs one fewer."""
    from modules.sync.outer_deadlines import OuterDeadlines

    hv = _background_outer({}, [PEER_B, PEER_C], averaging_s=5.0)
    hv.deadlines = OuterDeadlines(0.5, 5.0, None, "test", max_widen=4.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(2, 5.0, [], hv.log), {0, 1, 2}
    hv._best_peer_rounds = lambda live_only=False: -1.0
    t0, sizes, steps = time.monotonic(), [], []
    hv.roster.live = lambda max_age_s=0.0: {0, 1, 2} if time.monotonic() - t0 < 1.0 else {0, 1}
    hv._set_group_size, hv._reach = (lambda size, minimum: sizes.append((size, minimum))), (
        lambda index: None)
    hv.averager.set_group_bits = lambda bits: None

    def step(**kw):
        steps.append(_Step(None, polls=1000) if not steps else _Step(
            {b"a": _g(0, 3), b"b": _g(1, 3)}))
        return steps[-1]

    def roster_group(index, live, weight):
        raise RuntimeError("replica 2 was killed mid-round")

    hv._fixed, hv.averager.step = roster_group, step
    assert hv._round(3, 1.0) == [0, 1]
    assert sizes == [(3, 3), (2, 2)] and steps[0].cancelled
    assert time.monotonic() - t0 < 3.0 and hv.deadlines.widen == 1.0
    assert any("fewer than the 3 replicas it waited for" in x for x in hv.lines), hv.lines


def test_an_attempt_that_failed_at_once_does_not_widen_the_deadlines():
    """A roster group that fails at once (a dead replica still listed) missed no deadline:
    the deadlines stay (widened, the survivors' next group waited twice as long for the dead
    one: the fault row's stall 5.3 -> 12.3 s)."""
    from modules.sync.outer_deadlines import OuterDeadlines

    hv = _background_outer({}, [PEER_B], averaging_s=1.0)
    hv.deadlines = OuterDeadlines(0.5, 1.0, None, "test", max_widen=4.0)
    hv.live, hv.guard, hv.last_group = set(), SplitGuard(2, 5.0, [], hv.log), {0, 1}
    hv._set_group_size, hv._reach = (lambda size, minimum: None), (lambda index: None)
    hv.averager.set_group_bits = lambda bits: None

    def roster_group(index, live, weight):
        raise RuntimeError("a peer left the round mid-way")

    hv._fixed = roster_group
    hv.averager.step = lambda timeout, **kw: _Step(
        {b"a": _g(0, 4), b"b": _g(1, 4)})
    assert hv._round(4, 1.0) == [0, 1]
    assert hv.deadlines.widen == 1.0 and not [x for x in hv.lines if "widened" in x]

