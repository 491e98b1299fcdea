"""What the hivemind outer backend checks before it uses anything a peer sent: the run's
identity (a fingerprint of the model and plan, so two runs on one --run-id refuse each other by
name), each contribution to an average (the right size, finite, a norm bound relative to the
reducer's own), roster records and shared outer states. Pure functions on tensors and plain
values: the averager process and the host process both call them."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from typing import Any

import torch

NORM_BOUND = 8.0
"""A contribution whose norm exceeds this many times the reference (the reducer's own
contribution to that chunk, or the median when it has none) is left out of the round: honest
replicas' pseudo-gradients differ by far less; a replica that scales its own by -20 does not."""
MEAN_BOUND = NORM_BOUND
"""A mean sent back by a chunk's reducer whose norm exceeds this many times my own part of that
chunk is refused (the round fails here): a mean of honest parts is no larger than the largest
of them; a reducer that put a scaled or forged contribution into its own chunk is caught."""
STATE_SOURCES = 2
"""Peers a state download tries (by declared priority) before it gives up."""
MAX_COUNT = 1 << 31
"""Largest round count or replica number a peer's record may carry."""
IDENTITY_KEYS = ("model", "model_config", "stages", "sync")
"""The plan's parts every replica of one run must share (the cluster and predictions may
differ between hosts that planned apart under one --run-id)."""


def run_fingerprint(plan: dict[str, Any], compression: str) -> str:
    """The fingerprint of what replicas of one run must agree on: the plan's model, stage
    layout and sync settings, and the payload's compression."""
    agreed = {k: plan.get(k) for k in IDENTITY_KEYS}
    agreed["compression"] = compression
    text = json.dumps(agreed, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def part_identity(fingerprint: str, part: str, numel: int) -> str:
    """The identity of one averaged part (a stage, or a stage's shard) of a run: the run's
    fingerprint, the part and its parameter count."""
    return hashlib.sha256(f"{fingerprint}|{part}|{numel}".encode()).hexdigest()[:16]


def norm_of(part: torch.Tensor) -> float:
    """The L2 norm of `part` in one pass; not finite when any value is NaN or infinite (or
    so large that its square overflows fp32: no honest pseudo-gradient is)."""
    return float(torch.linalg.vector_norm(part if part.dtype == torch.float32 else part.float()))


def part_fault(part: torch.Tensor | None, numel: int) -> str | None:
    """Why a contribution to one chunk cannot be averaged (None: it can)."""
    return _fault_and_norm(part, numel)[0]


def _fault_and_norm(part: torch.Tensor | None, numel: int) -> tuple[str | None, float]:
    """(why `part` cannot be averaged or None, its norm): one pass over the values (the
    norm tells non-finite values: the checks cost a fraction of the codec's work)."""
    if part is None:
        return "a cut or undecodable message", 0.0
    if part.numel() != numel:
        return f"{part.numel()} values for a chunk of {numel}", 0.0
    n = norm_of(part)
    if not math.isfinite(n):
        return "non-finite values (NaN or infinity) or an overflowing norm", n
    return None, n


def mean_fault(mean: torch.Tensor | None, numel: int, own_norm: float | None,
               bound: float = MEAN_BOUND) -> str | None:
    """Why a reducer's mean of one chunk is refused (None: taken): the wrong size, non-finite,
    or a norm over `bound` times my own part's (`own_norm`; None: I contributed nothing)."""
    fault, n = _fault_and_norm(mean, numel)
    if fault is not None or own_norm is None or own_norm <= 0.0:
        return fault
    if n > bound * own_norm:
        return f"norm {n:.3g}, over {bound:g}x my own part's {own_norm:.3g}"
    return None


def contribution_faults(parts: dict[int, torch.Tensor | None], numel: int,
                        trusted: int | None, bound: float = NORM_BOUND) -> dict[int, str]:
    """Sender -> why its part of one chunk is left out: the wrong size, non-finite, or a norm
    over `bound` times the reference: the median norm of three or more parts (the reducer's
    own included: a replica that scaled its own is left out by its own reducer too), else the
    norm of sender `trusted`'s part (the reducer itself, never left out for its norm then)."""
    faults, norms = {}, {}
    for i, t in parts.items():
        fault, n = _fault_and_norm(t, numel)
        if fault is None:
            norms[i] = n
        else:
            faults[i] = fault
    if not norms:
        return faults
    if len(norms) < 3 and trusted in norms:
        ref = norms[trusted]
    else:
        ref, trusted = statistics.median(norms.values()), None
    if ref <= 0.0:  # nothing to compare with (an all-zero chunk)
        return faults
    for i, n in norms.items():
        if i != trusted and n > bound * ref:
            faults[i] = f"norm {n:.3g}, over {bound:g}x the reference {ref:.3g}"
    return faults


OWNER_MARK = b"[owner:"
"""Where an owned subkey's owner key starts (hivemind's RSASignatureValidator)."""


def roster_record(key: Any, value: Any
                  ) -> tuple[int, str, list[str], str, str, bytes] | None:
    """(replica, peer id, addresses, identity, membership proof, subkey owner) of a
    well-formed roster record, else None. The subkey is the replica (int or digits), or its
    digits then an owner tag (b"3[owner:...]"; owner b"" without one); a record without a
    proof (3 fields) has proof "" (never valid)."""
    owner = b""
    if isinstance(key, bytes) and OWNER_MARK in key[:10 + len(OWNER_MARK)]:  # <= 10 digits
        digits, owner = key[:key.index(OWNER_MARK)], key[key.index(OWNER_MARK):]
        key = digits.decode("ascii", "replace")
    if isinstance(key, bool) or not isinstance(key, int | str):
        return None
    if isinstance(key, str) and not (key.isascii() and key.isdigit() and len(key) < 10):
        return None
    replica = int(key)
    if not 0 <= replica < MAX_COUNT:
        return None
    if not (isinstance(value, list) and len(value) in (3, 4)):
        return None
    peer, maddrs, identity, proof = [*value, ""][:4]
    # a libp2p peer id in base58 is 46 (RSA, "Qm...") to 52 (ed25519, "12D3KooW...") long
    if not (isinstance(peer, str) and 40 <= len(peer) <= 64 and isinstance(identity, str)
            and isinstance(proof, str) and len(proof) <= 64
            and isinstance(maddrs, list) and len(maddrs) < 64
            and all(isinstance(m, str) and len(m) < 300 for m in maddrs)):
        return None
    try:
        from hivemind.p2p import PeerID

        if PeerID.from_base58(peer).to_base58() != peer:
            return None
    except Exception:  # noqa: BLE001 - not a peer id: an outsider's record
        return None
    return replica, peer, list(maddrs), identity, proof, owner


def _count(meta: dict, key: str) -> int | None:
    """meta[key] when it is a plausible count, else None."""
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_COUNT else None


def state_fault(meta: Any, tensors: Any, identity: str, numel: int,
                after_round: int = -1) -> str | None:
    """Why a peer's shared outer state is not taken (None: it is): another run's or part's
    identity, counts that are no counts, a round not past `after_round` (the round this
    replica failed), or tensors of the wrong size or not finite."""
    if not isinstance(meta, dict) or not isinstance(tensors, list | tuple):
        return "not a shared outer state"
    if meta.get("identity") != identity:
        return (f"another run's or part's state (fingerprint {str(meta.get('identity'))[:16]}, "
                f"this run's {identity})")
    outer, done = _count(meta, "outer_count"), _count(meta, "completed")
    if outer is None or done is None:
        return "round counts that are not counts"
    if outer <= after_round:
        return f"round {outer}, not past round {after_round + 1}, which failed here"
    results = meta.get("results", [])
    if not (isinstance(results, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                              and 0 <= r < MAX_COUNT for r in results)):
        return "averaged-round numbers that are not counts"
    need = [0] + ([1] if meta.get("momentum") else []) + [2 + i for i in range(len(results))]
    if len(tensors) < 2 + len(results):
        return f"{len(tensors)} tensors, fewer than its metadata lists"
    for i in need:
        fault = part_fault(tensors[i].reshape(-1) if isinstance(tensors[i], torch.Tensor)
                           else None, numel)
        if fault is not None:
            return f"tensor {i}: {fault}"
    return None
