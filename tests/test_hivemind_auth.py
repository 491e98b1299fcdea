"""PeerProof: a membership proof is bound to the secret, the run and the peer id; the roster,
matchmaking and the peers' declarations trust only peers that prove themselves members."""

import asyncio

import pytest

from modules.sync.hivemind_auth import NOT_A_MEMBER, PeerProof

PEER = "12D3KooWGzRQk1h8xGgQyqzHhA5Qf3b1T5uT6vA2GmZr9c8kPq7L"


def test_proof_holds_only_for_its_peer_run_and_secret():
    proof = PeerProof(b"s3cret", "run-a")
    token = proof.of(PEER)
    assert len(token) == 64 and proof.holds(PEER, token)
    assert not proof.holds(PEER[:-1] + "M", token)  # another peer cannot replay it
    assert not PeerProof(b"s3cret", "run-b").holds(PEER, token)  # nor another run
    assert not PeerProof(b"other", "run-a").holds(PEER, token)  # nor another secret


def test_malformed_proofs_are_refused_not_raised():
    proof = PeerProof(b"s3cret", "run-a")
    for bad in (None, 7, b"\x00" * 32, "", "ab", proof.of(PEER).upper()[:63], [proof.of(PEER)]):
        assert not proof.holds(PEER, bad)


def test_repr_never_shows_the_secret():
    assert "s3cret" not in repr(PeerProof(b"s3cret", "run-a"))
    assert "s3cret" not in str(PeerProof(b"s3cret", "run-a"))


# --- the proofs where the run uses them: roster, matchmaking, declarations -----------------

ME = "12D3KooWBpJ5MYtL1QxfmJV1CyweZGo8w2zuDEW3J5E9z6P7oJra"  # testkit.hivemind_runs.FAKE_PEER_ID
OTHER = "12D3KooWEc18wRzA5EdjBmbApgEM78K2VMS3nWa4N523d64XHEph"


def _roster(lines, proof):
    pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")
    from hivemind.utils import ValueWithExpiration

    from modules.sync.hivemind_dht import Roster
    from testkit.hivemind_runs import FakeDHT

    class StoringDHT(FakeDHT):
        def store(self, key, subkey, value, expiration_time, return_future=False):
            import concurrent.futures

            self.calls.append(("store", key, subkey, value))
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(True)
            return future

    dht = StoringDHT()
    roster = Roster(dht, "rt", 0, 0, 3.0, log=lines.append, client_mode=True, identity="me",
                    proof=proof)
    roster._link = lambda entries: None

    def answer(records):
        dht.answers["rt_roster_s0"] = ValueWithExpiration(
            {k: ValueWithExpiration(v, 2e9) for k, v in records.items()}, 2e9)
    return dht, roster, answer


def test_the_roster_announces_a_proof_and_uses_only_proven_entries():
    """My entry is written under a subkey only I can change (my replica and my owner tag) and
    carries my proof, bound to that tag; an entry without a valid proof of its own peer
    (none, a forged one, one replayed from another peer or under another subkey's owner, one
    of another secret, one under a subkey without an owner) is refused, counted and named in
    one warning, and cannot stop the run with another identity; proven ones count and become
    the peers whose declarations are trusted."""
    proof, lines = PeerProof(b"k", "rt"), []
    dht, roster, answer = _roster(lines, proof)
    roster._announce()
    mine = roster.owner
    assert mine.startswith(b"[owner:") and len(mine) > 200  # an RSA public key
    assert dht.calls[-1] == ("store", "rt_roster_s0", b"0" + mine,
                             [ME, [], "me", proof.of(ME, mine)])
    theirs, outsider = b"[owner:ssh-rsa PEERS-KEY]", b"[owner:ssh-rsa OUTSIDERS-KEY]"
    answer({b"1" + theirs: [PEER, [], "me", proof.of(PEER, theirs)],
            b"2" + outsider: [OTHER, [], "other-run", "0" * 64],  # forged, another identity
            b"3" + outsider: [OTHER, [], "me"],  # no proof at all (an older version)
            b"4" + outsider: [OTHER, [], "me", proof.of(PEER, theirs)],  # PEER's, replayed
            b"1" + outsider: [PEER, [], "me", proof.of(PEER, theirs)],  # PEER's entry copied
            b"5" + outsider: [OTHER, [], "me", PeerProof(b"x", "rt").of(OTHER, outsider)],
            6: [OTHER, [], "me", proof.of(OTHER)]})  # no owner: no roster proof is unbound
    assert roster.live() == {0, 1} and roster.conflict is None
    assert len(roster.unproven) == 6 and roster.trusted() == {ME, PEER}
    assert roster.peers() == {PEER}
    assert len(lines) == 1 and "refused 6 entr(ies) of the DHT roster rt_roster_s0 (e.g. " \
        f"one naming peer {OTHER}): {NOT_A_MEMBER}" in lines[0], lines
    roster.live()
    assert len(lines) == 1, lines  # said once, not at every read


def test_a_proven_entry_of_another_identity_still_stops_the_run_by_name():
    from modules.sync.hivemind_dht import RunMismatch

    proof, theirs = PeerProof(b"k", "rt"), b"[owner:ssh-rsa PEERS-KEY]"
    _, roster, answer = _roster([], proof)
    answer({b"1" + theirs: [PEER, [], "other-run", proof.of(PEER, theirs)]})
    with pytest.raises(RunMismatch, match="replica 1 .* is another run"):
        roster.live()


def test_a_group_with_a_stranger_fails_before_any_data_moves():
    """ExactAverager: a matchmaking group in which a peer's gather carries no valid proof
    fails at once (AllreduceException naming the peer), and the peer becomes a suspect (never
    a source of state); a group of members passes; without a proof nothing is checked."""
    pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")
    from hivemind.averaging.partition import AllreduceException
    from hivemind.p2p import PeerID

    from modules.sync.hivemind_exact import ExactAverager

    me, peer, other = (PeerID.from_base58(p) for p in (ME, PEER, OTHER))

    class Unstarted(ExactAverager):  # no process, no DHT: only what the check reads
        peer_id = me

        def __del__(self):
            pass

    proof = PeerProof(b"k", "rt")
    av = Unstarted.__new__(Unstarted)
    av.proof, av._suspects = proof, set()
    av._refuse_strangers({me: {"replica": 0}, peer: {"replica": 1, "proof": proof.of(PEER)}})
    for data in ({"replica": 2}, {"replica": 2, "proof": proof.of(PEER)}, "not a dict"):
        with pytest.raises(AllreduceException, match=f"peer {OTHER} of the group is not a"):
            av._refuse_strangers({me: {"replica": 0}, other: data})
    assert av._suspects == {OTHER}
    loop = asyncio.new_event_loop()  # the group's registration fails too: waiting parts end
    try:
        running = loop.create_future()
        with pytest.raises(AllreduceException):
            av._refuse_strangers({me: {}, other: {"replica": 2}}, running)
        assert isinstance(running.exception(), AllreduceException)
    finally:
        loop.close()
    assert av._gathered_of(OTHER, 2) == {"replica": 2, "proof": proof.of(OTHER)}
    av.proof = None
    av._refuse_strangers({me: {}, other: {"replica": 2}})
    assert av._gathered_of(OTHER, 2) == {"replica": 2}


@pytest.mark.timeout(180)
def test_a_replica_with_another_secret_never_enters_the_run(tmp_path):
    """Three processes on one DHT and --run-id: replica 2 holds another ST_RUN_SECRET and is
    the others' initial peer. Replicas 0 and 1 refuse its roster entry by name, train and
    end bit-identical; it never averages with them: it names their entries as refused too and
    stops (exit 1) with one line once it found no other member within --timeout-s."""
    pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")
    from testkit.fault_harness import write_trial_plan
    from testkit.hivemind_runs import HivemindRun, load_models, max_param_diff

    run = HivemindRun(write_trial_plan(tmp_path / "plan.json", 3, 1, "diloco", inner_steps=5),
                      tmp_path)
    common = ("--steps", "20", "--ckpt-dir", str(tmp_path / "ck"), "--fake-data",
              "--run-id", "shared")
    try:
        run.start(2, *common, "--timeout-s", "20", secret="another-secret-" + "x" * 32)
        peers = run.peers_of(2)
        outsider = peers.rsplit("/p2p/", 1)[1]
        assert run.wait_for(2, r"waiting for 3 replicas", 90), run.output(2)
        for r in (0, 1):
            run.start(r, *common, "--replicas", "0,1", peers=peers)
        codes = run.wait_progressing(stall_s=60, limit_s=150)
        logs = "\n".join(f"[{r}] {run.output(r)[-2500:]}" for r in range(3))
        assert codes == {0: 0, 1: 0, 2: 1}, (codes, logs)
        for r in (0, 1):
            assert f"refused 1 entr(ies) of the DHT roster shared_roster_s0 (e.g. one naming " \
                   f"peer {outsider}): {NOT_A_MEMBER}" in run.output(r), logs
        assert "entr(ies) of the DHT roster shared_roster_s0" in run.output(2), logs
        assert ("only replicas [2] were live in the DHT for 20 s (--timeout-s), fewer than "
                "--min-replicas 2; 2 roster entr(ies) there prove no membership (another "
                "run secret?): start every replica with the same ST_RUN_SECRET"
                ) in run.output(2), logs
        assert max_param_diff(load_models(tmp_path / "ck", [0, 1], 20)) == 0.0, logs
        assert "Traceback" not in logs, logs
    finally:
        run.stop()
    assert run.p2pd_left() == []


@pytest.mark.timeout(90)
def test_nobody_else_can_overwrite_a_replicas_roster_entry():
    """Two real DHT nodes: a replica's entry is under its owned subkey; an outsider's DHT
    (its own RSA key, or no validator at all) that writes that subkey with a later expiration
    is refused, and the entry reads back unchanged (before, any later record hid it)."""
    pytest.importorskip("hivemind", reason="hivemind is not installed (pip install -e .[hivemind])")
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from modules.sync.hivemind_dht import owner_tag, start_dht, visible_maddrs

    loop = ["/ip4/127.0.0.1/tcp/0"]
    member = start_dht([], loop, [], False, 30)
    peers = visible_maddrs(member)
    other = start_dht(peers, loop, [], False, 30)  # another replica's node
    outsiders = [DHT(initial_peers=peers, host_maddrs=loop, start=True,
                     record_validators=[RSASignatureValidator(RSAPrivateKey())]),
                 DHT(initial_peers=peers, host_maddrs=loop, start=True)]
    try:
        subkey, now = b"1" + owner_tag(), get_dht_time()
        assert member.store("rt_roster_s0", ["mine"], now + 30, subkey=subkey)
        for i, outsider in enumerate(outsiders):
            outsider.store("rt_roster_s0", [f"forged {i}"], now + 300 + i, subkey=subkey)
            outsider.store("rt_roster_s0", ["theirs"], now + 300, subkey=b"2")  # unowned: ok
        for reader in (member, other):  # what the run's replicas read
            got = reader.get("rt_roster_s0", latest=True).value
            assert got[subkey].value == ["mine"] and got[b"2"].value == ["theirs"], got
    finally:
        for dht in (*outsiders, other, member):
            dht.shutdown()


def test_a_local_replica_listens_on_loopback_only():
    """--host-maddrs not given: loopback when every initial peer is on this host's loopback;
    every interface for a first node or when an initial peer is elsewhere."""
    from modules.sync.hivemind_dht import DEFAULT_LISTEN, LOOPBACK_LISTEN, default_listen

    here, there = f"/ip4/127.0.0.1/tcp/4001/p2p/{ME}", f"/ip4/192.0.2.7/tcp/4001/p2p/{ME}"
    assert default_listen([here, f"/ip6/::1/tcp/4002/p2p/{ME}"]) == [LOOPBACK_LISTEN]
    assert default_listen([]) == [DEFAULT_LISTEN] == default_listen([here, there])
    assert default_listen([f"/dns4/localhost/tcp/4001/p2p/{ME}"]) == [DEFAULT_LISTEN]
