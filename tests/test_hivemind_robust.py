"""The hivemind outer backend against bad peers (modules/sync/hivemind_checks.py and its
callers): every contribution to an average is checked before it counts (size, finite, a norm
bound) and a left-out sender is named; outsiders' roster records are ignored and counted,
never parsed into a crash; a shared state is taken only when it agrees with the run; two runs
on one --run-id refuse each other by name; --client-mode without a full peer is an error."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")

from modules.comm import PeerError  # noqa: E402
from modules.sync.hivemind_checks import (  # noqa: E402
    contribution_faults,
    mean_fault,
    part_identity,
    roster_record,
    run_fingerprint,
    state_fault,
)
from modules.sync.hivemind_dht import Roster, RunMismatch, start_dht, visible_maddrs  # noqa: E402
from modules.sync.hivemind_exact import (  # noqa: E402
    CodecWire,
    ExactAverager,
    OrderedReducer,
    owner_views,
)
from modules.sync.hivemind_offenders import EXCLUDE_AFTER, EXCLUDED, Offenders  # noqa: E402
from testkit.fault_harness import write_trial_plan  # noqa: E402
from testkit.hivemind_runs import FakeDHT, HivemindRun  # noqa: E402

LOOP = ["/ip4/127.0.0.1/tcp/0"]
PEER_A = "12D3KooWBpJ5MYtL1QxfmJV1CyweZGo8w2zuDEW3J5E9z6P7oJra"
PEER_B = "12D3KooWSjtLceP4PpkctnkcgjdXoGBmC2skoLb12ybijWGAF3EB"


def test_contributions_of_the_wrong_size_nonfinite_or_far_too_large_are_left_out():
    """Size, NaN/inf and the norm bound (the reducer's own part with two senders, the median
    with three, so a replica that scaled its own is left out by its own reducer too)."""
    a = torch.randn(1000)
    nan = a.clone()
    nan[7] = float("nan")
    faults = contribution_faults({0: a, 1: nan, 2: a[:10], 3: None}, 1000, trusted=0)
    assert set(faults) == {1, 2, 3} and "non-finite" in faults[1] and "10 values" in faults[2]
    assert "cut" in faults[3]
    two = contribution_faults({0: a, 1: -20 * a}, 1000, trusted=0)
    assert set(two) == {1} and "norm" in two[1]
    three = contribution_faults({0: a, 1: 1.5 * a, 2: -20 * a}, 1000, trusted=2)
    assert set(three) == {2}
    assert contribution_faults({0: a, 1: 3 * a}, 1000, trusted=0) == {}  # honest spread
    assert contribution_faults({0: torch.zeros(1000), 1: a}, 1000, trusted=0) == {}
    assert mean_fault(-9.5 * a, 1000, float(a.norm())) is not None
    assert mean_fault(0.5 * a, 1000, float(a.norm())) is None
    assert mean_fault(50 * a, 1000, None) is None  # a weight-0 joiner bounds nothing


def test_a_shared_state_is_taken_only_when_it_agrees_with_the_run():
    meta = {"identity": "id1", "outer_count": 3, "completed": 3, "momentum": True}
    good = [torch.ones(5), torch.zeros(5)]
    assert state_fault(meta, good, "id1", 5, after_round=1) is None
    assert "another run" in state_fault(meta, good, "id2", 5)
    assert "5 values for a chunk of 7" in state_fault(meta, good, "id1", 7)
    assert "not past round 4" in state_fault(meta, good, "id1", 5, after_round=3)
    assert "non-finite" in state_fault(meta, [torch.ones(5), torch.full((5,), float("inf"))],
                                       "id1", 5)
    assert "counts" in state_fault({**meta, "completed": "x"}, good, "id1", 5)
    assert "not a shared" in state_fault([1, 2], good, "id1", 5)
    assert "fewer" in state_fault({**meta, "results": [2]}, good, "id1", 5)


def test_the_fingerprint_covers_the_model_and_plan_not_the_hosts():
    plan = {"model": "gpt-tiny", "model_config": None, "stages": [[0, 4]],
            "sync": {"inner_steps": 5}, "cluster": "a", "predicted": {"x": 1}}
    fp = run_fingerprint(plan, "int8")
    assert fp == run_fingerprint({**plan, "cluster": "b", "predicted": {}}, "int8")
    assert fp != run_fingerprint({**plan, "model": "gpt-small"}, "int8")
    assert fp != run_fingerprint({**plan, "sync": {"inner_steps": 6}}, "int8")
    assert fp != run_fingerprint(plan, "fp16")
    assert part_identity(fp, "0", 115008) != part_identity(fp, "0", 867072)


def _roster_value(records: dict):
    from hivemind.utils import ValueWithExpiration

    return ValueWithExpiration({k: ValueWithExpiration(v, 2e9) for k, v in records.items()}, 2e9)


def test_outsiders_roster_records_are_ignored_and_counted():
    """Records that are no entries of this run (an int() of a word crashed a replica) are
    ignored, counted once each and said once per order of magnitude; the run's own entries
    count."""
    dht, lines = FakeDHT(), []
    roster = Roster(dht, "rt", 0, 0, 3.0, log=lines.append, client_mode=True, identity="me")
    roster._link = lambda entries: None
    dht.answers["rt_roster_s0"] = _roster_value({
        "garbage": [PEER_B, [], "me"], 5: "not a list", 6: [1, 2, 3], 7: ["nopeer", [], "me"],
        8: [PEER_B, ["x" * 1000], "me"], -1: [PEER_B, [], "me"], 1: [PEER_B, [], "me"]})
    assert roster.live() == {0, 1} and len(roster.ignored) == 6
    assert roster.live() == {0, 1} and len(roster.ignored) == 6  # the same ones, read again
    assert len(lines) == 1 and "ignored 6 record(s)" in lines[0], lines
    assert roster_record(True, [PEER_B, [], "me"]) is None
    assert roster_record("2", [PEER_B, ["/ip4/1.2.3.4/tcp/1"], "me"])[0] == 2
    owned = roster_record(b"1234567[owner:ssh-rsa K]", [PEER_B, [], "me", "p"])
    assert owned is not None and owned[0] == 1234567 and owned[5] == b"[owner:ssh-rsa K]"


def test_an_entry_of_another_run_on_the_run_id_is_refused_by_name():
    dht = FakeDHT()
    roster = Roster(dht, "rt", 0, 0, 3.0, log=print, client_mode=True, identity="me")
    roster._link = lambda entries: None
    dht.answers["rt_roster_s0"] = _roster_value({1: [PEER_B, [], "other"]})
    with pytest.raises(RunMismatch, match=r"--run-id rt: replica 1 .* is another run"):
        roster.live()
    with pytest.raises(RunMismatch):  # and stays refused
        roster.live()


def test_a_group_with_another_runs_replica_is_refused_by_name():
    from modules.sync.hivemind_outer import same_round

    gathered = {b"a": {"replica": 0, "round": 2, "id": "me"},
                b"b": {"replica": 1, "round": 2, "id": "them"}}
    with pytest.raises(RunMismatch, match="replica 1 of the group that formed is another run"):
        same_round(gathered, 2, "me")


def test_a_client_without_a_full_peer_is_an_error():
    from modules.sync.hivemind_outer import HivemindOuter, HivemindSettings

    hv = HivemindOuter.__new__(HivemindOuter)
    hv.cfg = HivemindSettings((), (), (), True, "run", 3.0, 3.0, 1, 1, "none", None, None)
    hv.what = "stage 0"

    class Roster:
        def peers(self, sharing=False):
            return set()

    hv.roster = Roster()
    with pytest.raises(PeerError, match="--client-mode: no replica without --client-mode"):
        hv._need_full_peer()


def test_a_left_out_contribution_is_named_in_the_log_with_a_count():
    from modules.sync.hivemind_outer import HivemindOuter

    hv = HivemindOuter.__new__(HivemindOuter)
    hv.what, hv.averager, lines = "stage 0", None, []
    hv.log = lines.append
    hv.offenders = Offenders(hv.what, hv.log)
    gathered = {b"a": {"replica": 0}, b"b": {"replica": 2, "rejected": "norm 2e3, over 8x",
                                             "peer": PEER_B}}
    hv._note_rejected(4, gathered)
    hv._note_rejected(5, {**gathered, b"c": "not a dict"})
    assert lines == [f"outer round {k} of stage 0: left out the contribution of replica 2 "
                     f"(peer {PEER_B}) to the chunks reduced here: norm 2e3, over 8x ({n} "
                     "time(s) so far)" for k, n in ((5, 1), (6, 2))], lines


def test_a_repeat_offender_is_excluded_once_and_the_averager_told():
    """EXCLUDE_AFTER rounds with a left-out contribution: one line names the peer and replica
    as excluded, and its peer id goes to the averager's process once; later rounds' parts left
    out as excluded say nothing more. My own peer id is never excluded (the median can leave
    an honest reducer's own part out)."""
    from modules.sync.hivemind_outer import HivemindOuter

    told = []

    class Averager:
        class _outer_pipe:  # noqa: N801 - the averager's control pipe
            send = told.append

    hv = HivemindOuter.__new__(HivemindOuter)
    hv.what, hv.averager, lines = "stage 0", Averager(), []
    hv.log = lines.append
    hv.offenders = Offenders(hv.what, hv.log, me=PEER_A)
    bad = {b"a": {"replica": 0, "rejected": "norm 9e3, over 8x", "peer": PEER_A},
           b"b": {"replica": 2, "rejected": "norm 2e3, over 8x", "peer": PEER_B}}
    for k in range(EXCLUDE_AFTER):
        assert told == []
        hv._note_rejected(k, bad)
    assert told == [("_exclude_peers", [[PEER_B]], {})]
    excluding = [x for x in lines if "excluding" in x]
    assert excluding == [f"outer round {EXCLUDE_AFTER} of stage 0: excluding peer {PEER_B} "
                         f"(replica 2) from the average: {EXCLUDE_AFTER} contributions left "
                         "out here; its parts are left out of every later round here, "
                         "whatever they hold (it still receives the average)"], lines
    count = len(lines)
    hv._note_rejected(EXCLUDE_AFTER, {b"b": {"replica": 2, "rejected": EXCLUDED,
                                             "peer": PEER_B}})
    assert len(lines) == count and len(told) == 1  # said once
    assert hv.offenders.excluded == {PEER_B}


async def _reduce(parts: dict, me: int, excluded: set[int]):
    """One chunk of len(parts) senders through OrderedReducer: (the mean, rejected)."""
    import asyncio

    numel = next(iter(parts.values())).numel()
    reducer = OrderedReducer([torch.Size([numel])], len(parts), [me], CodecWire("none"),
                             me=me, excluded=excluded)
    means = await asyncio.gather(*(reducer.accumulate_part(i, 0, t) for i, t in parts.items()))
    assert all(torch.equal(means[0], m) for m in means[1:])
    return means[0], reducer.rejected


def test_an_excluded_senders_part_is_left_out_even_when_it_passes_the_checks():
    """Sender 2's part, 3x an honest one, passes the norm bound and counts; once sender 2 is
    excluded it is left out with the reason EXCLUDED and the mean is the honest pair's. With
    every other sender excluded, the chunk's mean is my own part (the round still completes);
    my own index in `excluded` changes nothing."""
    import asyncio

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(512, generator=g), torch.randn(512, generator=g)
    parts = {0: a, 1: b, 2: 3 * a}
    mean, rejected = asyncio.run(_reduce(parts, 0, set()))
    assert rejected == {} and torch.allclose(mean, (a + b + 3 * a) / 3)
    mean, rejected = asyncio.run(_reduce(parts, 0, {2}))
    assert rejected == {2: EXCLUDED} and torch.allclose(mean, (a + b) / 2)
    mean, rejected = asyncio.run(_reduce(parts, 1, {0, 1, 2}))
    assert rejected == {0: EXCLUDED, 2: EXCLUDED} and torch.equal(mean, b)


def _averagers(dhts, prefix, compression, numel):
    """One ExactAverager per DHT (peer i is replica i), aiming at a group of them all."""
    return [ExactAverager([torch.zeros(numel)], d, wire=CodecWire(compression), start=True,
                          prefix=prefix, target_group_size=len(dhts), min_matchmaking_time=5.0,
                          request_timeout=2.0, sender_timeout=20, reducer_timeout=40)
            for d in dhts]


def _round_of(dhts, inputs, prefix, compression):
    """One round of ExactAverager, peer i is replica i; (results, gathered data) per peer."""
    avs = _averagers(dhts, prefix, compression, inputs[0].numel())
    try:
        return _step_all(avs, inputs)
    finally:
        for a in avs:
            a.shutdown()


def _step_all(avs, inputs):
    """One round of the averagers `avs` (peer i holding inputs[i] and being replica i):
    (results, gathered data) per peer."""
    for a, x in zip(avs, inputs):
        with a.get_tensors() as ts:
            ts[0].copy_(x)
    gathered, errors = [None] * len(avs), []

    def go(i):
        try:
            gathered[i] = avs[i].step(gather={"replica": i}, timeout=40)
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
    assert not errors, errors
    return outs, gathered


@pytest.mark.timeout(120)
def test_a_poisoned_contribution_is_left_out_and_its_sender_named_on_every_peer():
    """Three real peers on loopback: replica 2 sends its pseudo-gradient scaled by -20 (int8),
    then one with a NaN (raw fp32 on the wire: our int8 encoder refuses to quantise a NaN, a
    forged message need not). Every peer ends bit-identical with the honest pair's mean, and
    every peer's gathered data names replica 2 as left out."""
    first = start_dht([], LOOP, [], False, 30)
    dhts = [first] + [start_dht(visible_maddrs(first), LOOP, [], False, 30) for _ in range(2)]
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(30_000, generator=g), torch.randn(30_000, generator=g)
        nan = b.clone()
        nan[::7_000] = float("nan")  # in every peer's chunk
        for k, (bad, compression) in enumerate(((-20 * a, "int8"), (nan, "none"))):
            outs, gathered = _round_of(dhts, [a, b, bad], f"robust{k}", compression)
            assert all(torch.equal(outs[0], o) for o in outs[1:])
            gap = (outs[0] - (a + b) / 2).abs().max()
            assert gap < 0.05, gap
            for got in gathered:
                bad_ones = [v for v in got.values() if v.get("rejected")]
                assert [v["replica"] for v in bad_ones] == [2], got
    finally:
        for d in dhts:
            d.shutdown()


@pytest.mark.timeout(180)
def test_a_repeat_offender_is_excluded_after_its_offences_even_with_plausible_values():
    """Three real peers on loopback, each with its host's offence count (HivemindOuter's
    `_note_rejected`, which tells its averager's process whom to exclude): replica 2 sends
    -20x for EXCLUDE_AFTER rounds (left out, counted), then 3x an honest pseudo-gradient,
    under the norm bound. From that round on the honest reducers leave it out as excluded
    (their chunks are the honest pair's mean), and each honest host said so once."""
    from modules.sync.hivemind_outer import HivemindOuter

    first = start_dht([], LOOP, [], False, 30)
    dhts = [first] + [start_dht(visible_maddrs(first), LOOP, [], False, 30) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(30_000, generator=g), torch.randn(30_000, generator=g)
    avs = _averagers(dhts, "offenders", "int8", a.numel())
    try:
        hosts, lines = [], [[] for _ in avs]
        for av, out in zip(avs, lines):
            hv = HivemindOuter.__new__(HivemindOuter)
            hv.what, hv.averager, hv.log = "stage 0", av, out.append
            hv.offenders = Offenders(hv.what, hv.log, me=str(av.peer_id))
            hosts.append(hv)
        views, _, owners = owner_views(torch.arange(a.numel(), dtype=torch.float32), 3,
                                       CodecWire("int8").block)
        honest = torch.cat(views[:len(owners[0]) + len(owners[1])]).long()
        for k in range(EXCLUDE_AFTER + 2):
            bad = -20 * a if k < EXCLUDE_AFTER else 3 * a
            outs, gathered = _step_all(avs, [a, b, bad])
            assert all(torch.equal(outs[0], o) for o in outs[1:])
            gap = (outs[0] - (a + b) / 2)[honest].abs().max()
            assert gap < 0.05, (k, gap)
            for hv, got in zip(hosts, gathered):
                why = [v["rejected"] for v in got.values() if v.get("rejected")]
                if hv is not hosts[2]:
                    assert why == [EXCLUDED if k >= EXCLUDE_AFTER else why[0]], (k, got)
                    assert k >= EXCLUDE_AFTER or "norm" in why[0], (k, got)
                hv._note_rejected(k, got)
        peer = str(avs[2].peer_id)
        for out in lines[:2]:
            excluding = [x for x in out if "excluding" in x]
            assert len(excluding) == 1, out
            assert excluding[0].startswith(f"outer round {EXCLUDE_AFTER} of stage 0: excluding "
                                           f"peer {peer} (replica 2) from the average: "
                                           f"{EXCLUDE_AFTER} contributions left out"), out
        assert not any("excluding" in x for x in lines[2]), lines[2]  # never itself
    finally:
        for av in avs:
            av.shutdown()
        for d in dhts:
            d.shutdown()


def _plan(path, inner_steps):
    return write_trial_plan(path, 2, 1, "diloco", inner_steps=inner_steps)


@pytest.mark.timeout(120)
def test_two_runs_on_one_run_id_refuse_each_other_by_name(tmp_path):
    """Two runs of different plans (inner steps 5 and 4) given one --run-id: each stops with
    one line naming the run id and the other run's replica (it crashed on a size mismatch)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = HivemindRun(_plan(tmp_path / "a" / "plan.json", 5), tmp_path / "a")
    two = HivemindRun(_plan(tmp_path / "b" / "plan.json", 4), tmp_path / "b")
    args = ("--steps", "20", "--fake-data", "--run-id", "shared", "--timeout-s", "30")
    try:
        one.start(0, *args)
        two.start(1, *args, peers=one.peers_of(0))
        codes = {**one.wait(90), **two.wait(30)}
        outs = [one.output(0), two.output(1)]
        assert codes == {0: 1, 1: 1}, (codes, outs)
        for out in outs:
            assert "error: --run-id shared: replica" in out and "is another run" in out, out
            assert "Traceback" not in out, out
    finally:
        one.stop()
        two.stop()


@pytest.mark.timeout(90)
def test_client_mode_replicas_without_a_full_peer_stop_with_an_error(tmp_path):
    """A --client-mode replica that finds no full peer exits non-zero naming --client-mode,
    instead of training alone to exit 0."""
    first = start_dht([], LOOP, [], False, 30)  # a bare DHT node: no replica of the run
    run = HivemindRun(_plan(tmp_path / "plan.json", 5), tmp_path)
    try:
        t0 = time.monotonic()
        run.start(0, "--steps", "10", "--fake-data", "--client-mode", "--replicas", "0",
                  "--timeout-s", "10", peers=",".join(visible_maddrs(first)))
        code, out = run.wait(60)[0], run.output(0)
        assert code == 1 and "error: --client-mode: no replica without --client-mode" in out, out
        assert "Traceback" not in out and time.monotonic() - t0 < 60, out
    finally:
        run.stop()
        first.shutdown()


@pytest.mark.timeout(90)
def test_a_poisoned_shared_state_is_refused_naming_the_peer():
    """Two real peers: one shares an outer state with a NaN, then one of another run; the
    other's checked download refuses both, naming the peer and why, then takes a good one."""
    first = start_dht([], LOOP, [], False, 30)
    other = start_dht(visible_maddrs(first), LOOP, [], False, 30)
    shared = {"state": None}
    kwargs = dict(wire=CodecWire("none"), start=True, prefix="state", target_group_size=2,
                  min_matchmaking_time=2.0, request_timeout=2.0, declare_state_period=1.0)
    src = ExactAverager([torch.zeros(5)], first, state_fn=lambda: shared["state"], **kwargs)
    dst = ExactAverager([torch.zeros(5)], other, **kwargs)
    try:
        src.state_sharing_priority = 3.0
        peer = str(src.peer_id)
        meta = {"identity": "me", "outer_count": 3, "completed": 3, "momentum": False}
        check = {"identity": "me", "numel": 5, "after_round": 1}
        bad = torch.ones(5)
        bad[2] = float("nan")
        deadline = time.monotonic() + 40
        for state, why in (((meta, [bad, torch.zeros(0)]), "non-finite"),
                           (({**meta, "identity": "them"}, [torch.ones(5), torch.zeros(0)]),
                            "another run")):
            shared["state"] = state
            got, refused = None, []
            # until it declared its state, and a download got through (none may time out here)
            while (not refused or "no complete state" in refused[0][1]) \
                    and time.monotonic() < deadline:
                got, _, refused = dst.load_checked_state(check, [peer], 5.0)
                time.sleep(0.5)
            assert got is None and refused and refused[0][0] == peer, refused
            assert why in refused[0][1], refused
        shared["state"] = (meta, [torch.ones(5), torch.zeros(0)])
        got, tensors, refused = dst.load_checked_state(check, [peer], 5.0)
        while got is None and time.monotonic() < deadline + 30:  # a download that timed out
            got, tensors, refused = dst.load_checked_state(check, [peer], 5.0)
        assert got == meta and torch.equal(tensors[0], torch.ones(5)), refused
    finally:
        for part in (src, dst, first, other):
            part.shutdown()
