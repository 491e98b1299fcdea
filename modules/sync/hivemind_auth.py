"""Who belongs to a hivemind run: a peer proves it holds the run secret.

hivemind's DHT takes any peer's records and its matchmaking any peer that knows the prefix. A
libp2p connection does authenticate the peer id (it is the hash of the peer's public key, proved
in the handshake), so a proof bound to the peer id cannot be replayed by another peer: a member
publishes `HMAC-SHA256(run secret, run id, its peer id)` in its roster entry and in what it
gathers at matchmaking, and every replica checks it before trusting the peer, so a peer
without the secret never enters the roster, never contributes to an average and never
supplies a state.

Where it is checked: Roster._valid (an entry without a valid proof is refused and counted;
only proven peers' declarations count: Roster.trusted), ExactAverager._refuse_strangers (a
matchmaking group with a stranger fails before data moves: `stranger`) and, through the
roster, every state download. tests/test_hivemind_auth.py.
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

    def of(self, peer: str, *bound: bytes) -> str:
        """The proof that `peer` (base58 peer id) is a member (hex), valid only with `bound`
        (a roster entry's: its subkey's owner key, so a copy under another subkey fails)."""
        return tagged_mac(self._key, DOMAIN, self.run.encode(), peer.encode(), *bound)

    def holds(self, peer: str, proof: Any, *bound: bytes) -> bool:
        """Whether `proof` (as a peer sent it: any value) proves `peer` a member."""
        return mac_matches(proof, self.of(peer, *bound))

    def stranger(self, gathered: dict[str, Any], me: str) -> str | None:
        """The first peer of `gathered` (peer id -> what it gathered at matchmaking) other
        than `me` whose data carries no valid proof ({"proof": ...}), else None."""
        for peer, data in gathered.items():
            if peer != me and not self.holds(peer, data.get("proof")
                                             if isinstance(data, dict) else None):
                return peer
        return None
