"""Who belongs to a hivemind run: a peer proves it holds the run secret.

hivemind's DHT takes any peer's records and its matchmaking any peer that knows the prefix. A
libp2p connection does authenticate the peer id (it is the hash of the peer's public key, proved
in the handshake), so a proof bound to the peer id cannot be replayed by another peer: a member
would publish
`HMAC-SHA256(run secret, run id, its peer id)` in its roster entry and in what it gathers at
matchmaking, and every replica would check it before trusting the peer (in
modules.sync.hivemind_dht.Roster and ExactAverager._aggregate_with_group), so a peer without
the secret never enters the roster, never contributes to an average and never supplies a state.

Status: only the proof itself is here and tested (tests/test_hivemind_auth.py); nothing calls it
yet. Wiring it into the roster, matchmaking and state transfer is the open part of issue 46.
"""

from __future__ import annotations

from typing import Any

from formats.macs import mac_matches, tagged_mac

DOMAIN = b"st-hivemind/1"
"""Separates these proofs from the store's signed records (modules.control.auth: st-store/1)."""
NOT_A_MEMBER = ("not a member of this run: no valid proof of the run secret (a peer started "
                "with another ST_RUN_SECRET, or an outsider)")


class PeerProof:
    """Makes and checks the membership proof of a peer id in one run."""

    def __init__(self, secret: bytes, run: str) -> None:
        """`secret`: the run secret (modules.control.auth.load_secret); `run`: the run id."""
        self._key, self.run = secret, run

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"PeerProof(run={self.run!r})"

    def of(self, peer: str) -> str:
        """The proof that `peer` (base58 peer id) is a member (hex)."""
        return tagged_mac(self._key, DOMAIN, self.run.encode(), peer.encode())

    def holds(self, peer: str, proof: Any) -> bool:
        """Whether `proof` (as a peer sent it: any value) proves `peer` a member."""
        return mac_matches(proof, self.of(peer))
