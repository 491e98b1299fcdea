"""Store keys only the run can name: arrival flags, device announcements, NCCL ids and torch's
own process-group rendezvous (gloo's addresses, NCCL's unique ids, the store barrier).

Those records are read by torch's C++ (gloo, ProcessGroupNCCL) or only waited for (a flag's
presence is its message), so a signature on the value would need an extra read per record
(2 store round trips) or cannot be checked at all. Instead every such key is renamed
`KEY/#<MAC>`: the MAC (128 bits of an HMAC-SHA256 with the run secret over the key) makes the
name unguessable, and torch's TCPStore has no way to list keys, so an outsider who reaches the
port cannot write, overwrite, delete or wait on any of them. Waiting for a hidden flag is one
round trip, as before signing. What it does not stop: someone who sniffs the traffic learns
the names (docs/security.md: use the WireGuard tunnel on an untrusted network).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from modules.control.auth import Auth, AuthStore


class HiddenStore(dist.Store):
    """A torch Store (process groups take it like a TCPStore) whose every key is renamed
    `Auth.name(key)` in the store underneath."""

    def __init__(self, raw: dist.Store, auth: Auth) -> None:
        super().__init__()
        self.raw, self.auth = raw, auth

    def _n(self, key: str) -> str:
        return self.auth.name(key)

    def set(self, key: str, value: Any) -> None:  # noqa: D102 - torch.distributed.Store's
        self.raw.set(self._n(key), value)

    def get(self, key: str) -> bytes:  # noqa: D102
        return self.raw.get(self._n(key))

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return self.raw.add(self._n(key), value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        return self.raw.compare_set(self._n(key), expected, desired)

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self.raw.check([self._n(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # noqa: D102
        names = [self._n(k) for k in keys]
        if timeout is None:
            self.raw.wait(names)
        else:
            self.raw.wait(names, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:  # noqa: D102
        return self.raw.multi_get([self._n(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[Any]) -> None:  # noqa: D102
        self.raw.multi_set([self._n(k) for k in keys], values)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self.raw.delete_key(self._n(key))

    def num_keys(self) -> int:  # noqa: D102
        return self.raw.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:  # noqa: D102
        self.raw.set_timeout(timeout)


def hidden_store(store: Any) -> Any:
    """Where process groups, arrival flags and device announcements go: the run's HiddenStore
    for an AuthStore (made once per AuthStore: torch keeps using it), else the store itself
    (a bare store in unit tests)."""
    if not isinstance(store, AuthStore):
        return store
    if store.hidden is None:
        store.hidden = HiddenStore(store.raw, store.auth)
    return store.hidden
