"""PeerProof: a membership proof is bound to the secret, the run and the peer id."""

from modules.sync.hivemind_auth import PeerProof

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
