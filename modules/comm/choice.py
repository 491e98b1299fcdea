"""Which backend each group uses, gloo or cupy NCCL, decided the same way on every rank.

Every rank announces its device in the rendezvous store (kind, GPU index and uuid, host, and
whether cupy's NCCL imports there); every rank reads the announcements of a group's members
and calls the pure `choose_backend`, so the members agree without another round of messages.
`auto` picks NCCL for a group whose members are CUDA ranks on distinct GPUs (NCCL refuses two
ranks on one GPU) and gloo otherwise; gloo is also what to ask for across a WAN link or a
WireGuard tunnel where NCCL's socket transport misbehaves (gloo stages CUDA tensors through
pinned host memory).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from formats.errors import UserError
from modules.comm.errors import CommError, PeerError
from modules.comm.keys import device_key, wait_keys
from modules.comm.nccl import load_nccl
from modules.config import COMM_BACKENDS

REQUESTS = COMM_BACKENDS


@dataclass(frozen=True)
class CommOptions:
    """How a run's groups communicate (dist_runner's --comm and --device)."""

    backend: str = "gloo"
    """Requested backend: `auto` (NCCL for a group of CUDA ranks on distinct GPUs, gloo
    otherwise), `gloo`, or `nccl` (an error for a group where NCCL cannot run)."""
    device: str = "cpu"
    """This rank's device: `cpu`, `cuda` or `cuda:N`."""

    def __post_init__(self) -> None:
        if self.backend not in REQUESTS:
            raise UserError(f"--comm: {self.backend!r} is not one of {', '.join(REQUESTS)}")
        try:
            kind = torch.device(self.device).type
        except RuntimeError:
            kind = ""
        if kind not in ("cpu", "cuda"):
            raise UserError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")


@dataclass(frozen=True)
class DeviceInfo:
    """What a rank announces about its device."""

    kind: str
    """`cpu` or `cuda`."""
    host: str
    index: int | None = None
    """CUDA device index in the rank's process (None on CPU)."""
    uuid: str = ""
    """The GPU's uuid when torch reports it: two ranks on one GPU show the same."""
    nccl: bool = False
    """cupy with NCCL imports on this rank."""

    def gpu(self) -> str:
        """Identity of the GPU: its uuid, else host and index."""
        return self.uuid or f"{self.host}:{self.index}"

    def describe(self) -> str:
        """`cuda:1 on host h` / `cpu on host h`."""
        where = "cpu" if self.kind == "cpu" else f"cuda:{self.index}"
        return f"{where} on host {self.host}"

    def to_json(self) -> str:
        """Serialised for the store."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> DeviceInfo:
        """Parse what to_json wrote."""
        return DeviceInfo(**json.loads(text))


@dataclass(frozen=True)
class BackendChoice:
    """The backend of one group and why (logged, and for the run's metrics)."""

    group: str
    """The group's name, e.g. `stage0`, `tied1`, `pipeline0`."""
    ranks: tuple[int, ...]
    backend: str
    """`gloo` or `nccl`."""
    reason: str

    def describe(self) -> str:
        """`stage0 [0, 2]: nccl (CUDA ranks on distinct GPUs)`."""
        return f"{self.group} {list(self.ranks)}: {self.backend} ({self.reason})"


def local_device(device: torch.device | str) -> DeviceInfo:
    """This rank's DeviceInfo for `device` (CUDA is not touched for a CPU device)."""
    device = torch.device(device)
    host = socket.gethostname()
    if device.type != "cuda":
        return DeviceInfo("cpu", host)
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    try:
        load_nccl()
        nccl = True
    except CommError:
        nccl = False
    return DeviceInfo("cuda", host, index, uuid, nccl)


def nccl_problem(ranks: Sequence[int], devices: Mapping[int, DeviceInfo]) -> str | None:
    """Why NCCL cannot carry a group of `ranks`, or None when it can."""
    off_gpu = [r for r in ranks if devices[r].kind != "cuda"]
    if off_gpu:
        return f"rank(s) {off_gpu} not on a CUDA device"
    missing = [r for r in ranks if not devices[r].nccl]
    if missing:
        return f"rank(s) {missing} cannot import cupy's NCCL"
    owner: dict[str, int] = {}
    for r in ranks:
        first = owner.setdefault(devices[r].gpu(), r)
        if first != r:
            return (f"ranks {first} and {r} share one GPU ({devices[r].describe()}); NCCL needs "
                    "one rank per GPU")
    return None


def choose_backend(requested: str, group: str, ranks: Sequence[int],
                   devices: Mapping[int, DeviceInfo]) -> BackendChoice:
    """The backend of one group: a pure function of the request and the members' devices, so
    every rank computes the same. UserError when `nccl` is requested where it cannot run."""
    ranks = tuple(sorted(ranks))
    if requested == "gloo":
        return BackendChoice(group, ranks, "gloo", "requested")
    problem = nccl_problem(ranks, devices)
    if problem is None:
        return BackendChoice(group, ranks, "nccl",
                             "requested" if requested == "nccl" else "CUDA ranks on distinct GPUs")
    if requested == "nccl":
        raise UserError(f"--comm nccl: group {group} {list(ranks)} cannot use NCCL: {problem}; "
                        "use --comm auto or gloo")
    return BackendChoice(group, ranks, "gloo", problem)


def announce_device(store: dist.Store, rank: int, info: DeviceInfo) -> None:
    """Publish this rank's device for the others' backend choice."""
    store.set(device_key(rank), info.to_json())


def read_devices(store: dist.Store, ranks: Sequence[int], timeout_s: float,
                 ) -> dict[int, DeviceInfo]:
    """The devices `ranks` announced; PeerError naming those that did not within the timeout."""
    keys = [device_key(r) for r in ranks]
    late = wait_keys(store, ranks, keys, timeout_s)
    if late is not None:
        missing, why = late
        if missing is None:  # not a late peer: the store's host is gone (or cut off)
            raise PeerError(f"choosing the backends: the rendezvous store stopped answering "
                            f"({why})")
        raise PeerError(f"choosing the backends: rank(s) {missing} did not announce their "
                        f"device within {timeout_s:g} s ({why})")
    return {r: DeviceInfo.from_json(v) for r, v in zip(ranks, store.multi_get(keys))}
