"""The store keys the communicators read and write (device records, an NCCL communicator's
arrival and unique id) and the bounded wait on them: here, below modules.control, so the
communication layer needs nothing of the control layer. The rest of the runtime's keys are in
modules.control.protocol, which names these too in its list of every key.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any


def member_key(prefix: str, rank: int) -> str:
    """One rank's key under a prefix (arrival at an outer step or at an NCCL init)."""
    return f"{prefix}/{rank}"


def device_key(rank: int) -> str:
    """JSON of a rank's device (kind, GPU index and uuid, host, NCCL available)."""
    return f"comm/device/{rank}"


def nccl_unique_id_key(name: str, ranks: Sequence[int]) -> str:
    """The NCCL unique id of communicator `name` over `ranks` (made by the first rank)."""
    return f"comm/{name}/{'-'.join(map(str, ranks))}/nccl-unique-id"


def nccl_arrival_prefix(name: str, ranks: Sequence[int]) -> str:
    """Where the members of communicator `name` announce themselves before the NCCL init
    (`member_key(prefix, rank)`)."""
    return f"comm/{name}/{'-'.join(map(str, ranks))}/arrived"


def wait_keys(store: Any, ranks: Sequence[int], keys: Sequence[str],
              timeout_s: float) -> tuple[list[int] | None, str] | None:
    """Wait until every rank's key is set in the store: None when all are, else (the ranks
    whose key is missing, or None when the store itself stopped answering; the error's first
    line) after `timeout_s`."""
    try:
        store.wait(list(keys), timedelta(seconds=timeout_s))
        return None
    except RuntimeError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    try:
        return [r for r, k in zip(ranks, keys) if not store.check([k])], why
    except RuntimeError:
        return None, why
