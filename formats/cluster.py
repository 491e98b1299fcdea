"""Cluster files: devices and the links between them, in two forms.

`cluster/1` (full): N x N `latency_ms` and `bandwidth_gbps` matrices. Row i / column j of each
matrix is the device whose id is i / j; matrices are directional (row = sender).
`cluster/2` (compact, formats/compact.py): links per region pair, per device and per pair; for
swarms of thousands of devices, where the matrices would not fit in a file or in memory.
Device ids must be exactly 0..N-1 (rank = device id), in any order in the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats import checks
from formats.atomic_io import atomic_write_json
from formats.compact import (
    BANDWIDTH_RANGE_GBPS,
    COMPACT_FORMAT,
    MAX_LATENCY_MS,
    CompactLinks,
    bound_problem,
    compact_links_from_dict,
    compact_links_from_matrices,
)
from formats.errors import UserError
from formats.jsonfile import load_json
from formats.links import LinkClasses, identity_classes

CLUSTER_FORMAT = "cluster/1"
FORMATS = (CLUSTER_FORMAT, COMPACT_FORMAT)
MAX_CLUSTER_FILE_BYTES = 1 << 30
"""Largest cluster file read: the full form of 4096 devices (MAX_DENSE_DEVICES) is about
350 MB of text; larger swarms use the compact form."""
MAX_LABEL_CHARS = 1024
"""Longest name, region, host or GPU label."""
DEVICE_KEYS = ("id", "name", "region", "host", "gpu", "tflops", "memory_gb")
MAX_DENSE_DEVICES = 4096
"""Largest compact cluster whose N x N matrices are built on demand (2 x 134 MB at 4096)."""


@dataclass(frozen=True)
class Device:
    """One accelerator and where it sits."""

    id: int
    """Device id = torch.distributed rank; 0..N-1."""
    name: str
    """Human-readable name, e.g. `tokyo-3`."""
    region: str
    """Region or site; devices of one region usually share fast links."""
    host: str
    """Address of the machine that holds the device (for tc rules and SSH)."""
    gpu: str
    """GPU model, e.g. `V100-16GB`."""
    tflops: float
    """Peak dense FLOP/s of the device in TFLOP/s (published figure, fp16/bf16 tensor cores)."""
    memory_gb: float
    """Device memory in GB (1e9 bytes)."""


class Cluster:
    """Devices and the links between them: the full form (N x N matrices, `cluster/1`) or the
    compact one (links per region pair plus exceptions, `cluster/2`, formats/compact.py).

    Both answer `latency_ms` / `bandwidth_gbps` (N x N, row = sender; a compact cluster builds
    them on first use, up to MAX_DENSE_DEVICES devices) and `link_classes()`, which the planner
    works from without the matrices.
    """

    def __init__(self, name: str, devices: list[Device], latency_ms: np.ndarray | None = None,
                 bandwidth_gbps: np.ndarray | None = None, *,
                 compact: CompactLinks | None = None) -> None:
        """Give either both matrices (full form) or `compact` (compact form)."""
        assert (compact is None) == (latency_ms is not None and bandwidth_gbps is not None), \
            "a cluster has either both matrices or compact links"
        self.name, self.devices, self.compact = name, devices, compact
        self._latency_ms, self._bandwidth_gbps = latency_ms, bandwidth_gbps
        self._classes: LinkClasses | None = None

    @property
    def num_devices(self) -> int:
        """Number of devices N."""
        return len(self.devices)

    @property
    def is_compact(self) -> bool:
        """True for the compact form (links per region pair, matrices built on demand)."""
        return self.compact is not None

    @property
    def latency_ms(self) -> np.ndarray:
        """(N, N) one-way latency in milliseconds; row = sender. Diagonal is 0."""
        self._materialise()
        return self._latency_ms

    @property
    def bandwidth_gbps(self) -> np.ndarray:
        """(N, N) bandwidth in Gbit/s (1e9 bit/s); row = sender. Diagonal is ignored (0 or
        inf)."""
        self._materialise()
        return self._bandwidth_gbps

    def _materialise(self) -> None:
        if self._latency_ms is not None:
            return
        n = self.num_devices
        if n > MAX_DENSE_DEVICES:
            raise UserError(
                f"cluster '{self.name}': {n} devices in the compact form; the full {n} x {n} "
                f"link matrices ({2 * 8 * n * n / 1e9:.1f} GB) are built only for up to "
                f"{MAX_DENSE_DEVICES} devices (the DT-FM objective plans without them)")
        lat, bw = self.link_classes().dense()
        lat.flags.writeable = bw.flags.writeable = False  # a cache: nobody may edit it
        self._latency_ms, self._bandwidth_gbps = lat, bw

    def link_classes(self) -> LinkClasses:
        """Links as classes plus exceptions (the full form: one class per device)."""
        if self._classes is None:
            self._classes = self.compact.classes() if self.compact is not None else \
                identity_classes(self._latency_ms, self._bandwidth_gbps)
        return self._classes

    def regions(self) -> list[str]:
        """Region of each device, indexed by id."""
        return [d.region for d in self.devices]

    def to_dict(self) -> dict[str, Any]:
        """The `cluster/1` JSON object, or `cluster/2` for a compact cluster."""
        head = {"name": self.name, "devices": [asdict(d) for d in self.devices]}
        if self.compact is not None:
            return {"format": COMPACT_FORMAT, **head, **self.compact.to_dict()}
        return {"format": CLUSTER_FORMAT, **head,
                "latency_ms": _matrix_to_list(self._latency_ms),
                "bandwidth_gbps": _matrix_to_list(self._bandwidth_gbps)}

    def sha256(self) -> str:
        """Digest of the canonical JSON (sorted keys, no spaces) of `to_dict()`, stored in plans
        to detect a plan/cluster mismatch. A compact cluster's digest is that of its compact
        form, not of the matrices it expands to."""
        if self.compact is not None:
            return hashlib.sha256(_canonical(self.to_dict()).encode()).hexdigest()
        digest = hashlib.sha256()
        # The same bytes as _canonical(self.to_dict()), written piece by piece: the matrices
        # as text straight from their distinct values (json.dumps of N^2 floats is slow).
        digest.update(b'{"bandwidth_gbps":')
        _hash_matrix(digest, self._bandwidth_gbps)
        digest.update(f',"devices":{_canonical([asdict(d) for d in self.devices])},'
                      f'"format":"{CLUSTER_FORMAT}","latency_ms":'.encode())
        _hash_matrix(digest, self._latency_ms)
        digest.update(f',"name":{_canonical(self.name)}}}'.encode())
        return digest.hexdigest()

    def with_devices(self, devices: list[Device]) -> Cluster:
        """The same links (and form) with other devices in the same places (e.g. measured
        tflops)."""
        assert [d.id for d in devices] == [d.id for d in self.devices], "same devices, same ids"
        if self.compact is not None:
            return Cluster(self.name, devices, compact=self.compact)
        return Cluster(self.name, devices, self._latency_ms, self._bandwidth_gbps)

    def to_compact(self) -> Cluster:
        """The same cluster in the compact form (most common link per region pair, every other
        link an exact pair link)."""
        if self.compact is not None:
            return self
        links = compact_links_from_matrices(self.regions(), self._latency_ms,
                                            self._bandwidth_gbps)
        return Cluster(self.name, list(self.devices), compact=links)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _rounded(m: np.ndarray) -> np.ndarray:
    """round(v, 6) of every entry, as Python's round does it, diagonal 0."""
    out = np.array(m, dtype=float)
    np.fill_diagonal(out, 0.0)
    # x == rint(x * 1e6) / 1e6 means x is the double nearest a 6-decimal number, which round()
    # returns unchanged (below 1e9, where a double's spacing is far under 1e-6).
    with np.errstate(invalid="ignore", over="ignore"):
        done = (np.rint(out * 1e6) / 1e6 == out) & (np.abs(out) < 1e9)
    if not done.all():
        values, inverse = np.unique(out[~done], return_inverse=True)
        out[~done] = np.array([round(float(v), 6) for v in values])[inverse.reshape(-1)]
    return out


def _matrix_to_list(m: np.ndarray) -> list[list[float]]:
    return _rounded(m).tolist()


def _hash_matrix(digest: Any, m: np.ndarray) -> None:
    """Feed the canonical JSON text of _matrix_to_list(m) to `digest`, row by row."""
    rounded = _rounded(m)
    if (np.signbit(rounded) & (rounded == 0)).any():  # -0.0 and 0.0 are one value to unique
        digest.update(_canonical(rounded.tolist()).encode())
        return
    values = np.unique(rounded)  # (without return_inverse: no argsort of N^2 entries)
    text = [json.dumps(float(v)) for v in values]
    rows = np.searchsorted(values, rounded).tolist()
    for k, row in enumerate(rows):
        digest.update((("[[" if k == 0 else "],[") + ",".join([text[i] for i in row])).encode())
    digest.update(b"]]" if rows else b"[]")


def _require(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing key '{key}'")
    return obj[key]


def _number(value: Any, where: str) -> float:
    if not checks.is_number(value):
        raise UserError(f"{where}: expected a number, got {checks.shown(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        raise UserError(f"{where}: expected a finite number, got {checks.shown(value)}") \
            from None


def _parse_device(raw: Any, index: int) -> Device:
    where = f"devices[{index}]"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in DEVICE_KEYS:
        _require(raw, key, where)
    dev_id = raw["id"]
    if isinstance(dev_id, bool) or not isinstance(dev_id, int):
        raise UserError(f"{where}.id: expected an integer, got {checks.shown(dev_id)}")
    tflops, memory_gb = (checks.as_finite(raw[k]) for k in ("tflops", "memory_gb"))
    if tflops is None or tflops <= 0:
        raise UserError(f"{where}.tflops: must be a positive number, got "
                        f"{checks.shown(raw['tflops'])}")
    if memory_gb is None or memory_gb <= 0:
        raise UserError(f"{where}.memory_gb: must be a positive number, got "
                        f"{checks.shown(raw['memory_gb'])}")
    for key, x in (("tflops", tflops), ("memory_gb", memory_gb)):
        why = bound_problem(key, x)
        if why is not None:
            raise UserError(f"{where}.{key}: {why}, got {x!r}")
    name, region, host, gpu = (checks.text(raw[k], f"{where}.{k}", MAX_LABEL_CHARS, empty=True)
                               for k in ("name", "region", "host", "gpu"))
    return Device(dev_id, name, region, host, gpu, tflops, memory_gb)


def _parse_matrix(raw: Any, field: str, n: int) -> np.ndarray:
    """An n x n matrix of numbers; the first bad row or entry named otherwise."""
    fast = _numeric_matrix(raw, n)
    if fast is not None:
        return fast
    if not isinstance(raw, list) or len(raw) != n:
        got = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise UserError(f"{field}: expected {n} rows (one per device), got {got}")
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != n:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise UserError(
                f"{field}[{i}]: expected {n} values (matrix must be {n}x{n}), got {got}")
        for j, v in enumerate(row):
            _number(v, f"{field}[{i}][{j}]")
    return np.array(raw, dtype=float)


def _numeric_matrix(raw: Any, n: int) -> np.ndarray | None:
    """The n x n matrix when every entry is an int or a float (the usual case), checked
    without a Python call per entry; None otherwise (the caller then names the bad entry)."""
    if not isinstance(raw, list) or len(raw) != n:
        return None
    try:
        m = np.array(raw)
    except (ValueError, TypeError, OverflowError):  # ragged, or not numbers
        return None
    if m.shape != (n, n) or m.dtype.kind not in "fi":
        return None
    # A JSON true/false among numbers becomes 1.0/0.0: look only at the entries that are.
    suspects = np.argwhere((m == 0) | (m == 1)).tolist()
    if any(type(raw[i][j]) is bool for i, j in suspects):
        return None
    return m.astype(float, copy=False)


def _check_links(lat: np.ndarray, bw: np.ndarray) -> None:
    n = lat.shape[0]
    off = ~np.eye(n, dtype=bool)
    for name, m, ok in (
        ("bandwidth_gbps", bw, np.isfinite(bw) & (bw > 0)),
        ("latency_ms", lat, np.isfinite(lat) & (lat >= 0)),
    ):
        bad = np.argwhere(off & ~ok)
        if not len(bad):
            _check_bounds(name, m, off)
        if len(bad):
            i, j = (int(x) for x in bad[0])
            need = "a positive finite number" if name == "bandwidth_gbps" else ">= 0 and finite"
            raise UserError(
                f"{name}[{i}][{j}]: {float(m[i, j])!r} between devices {i} and {j} must be {need}"
                f" ({len(bad)} bad entr{'y' if len(bad) == 1 else 'ies'} in all)"
            )


def _check_bounds(name: str, m: np.ndarray, off: np.ndarray) -> None:
    """UserError naming the first finite entry of a link matrix out of the accepted range."""
    lo, hi = (0.0, MAX_LATENCY_MS) if name == "latency_ms" else BANDWIDTH_RANGE_GBPS
    bad = np.argwhere(off & ((m < lo) | (m > hi)))
    if len(bad):
        i, j = (int(x) for x in bad[0])
        raise UserError(f"{name}[{i}][{j}]: {bound_problem(name, float(m[i, j]))}, got "
                        f"{float(m[i, j])!r} ({len(bad)} such entr"
                        f"{'y' if len(bad) == 1 else 'ies'} in all)")


def _parse_devices(obj: dict) -> list[Device]:
    """The devices, checked and sorted by id (ids exactly 0..N-1)."""
    raw_devices = _require(obj, "devices", "cluster")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise UserError("cluster.devices: expected a non-empty list of devices")
    devices = [_parse_device(d, i) for i, d in enumerate(raw_devices)]
    n = len(devices)
    seen: dict[int, int] = {}
    for i, d in enumerate(devices):
        if d.id in seen:
            raise UserError(f"devices[{i}].id: duplicate id {d.id} (also devices[{seen[d.id]}])")
        seen[d.id] = i
        if not 0 <= d.id < n:
            raise UserError(f"devices[{i}].id: {d.id} out of range; ids must be 0..{n - 1}")
    return sorted(devices, key=lambda d: d.id)


def cluster_from_dict(obj: Any) -> Cluster:
    """Validate a `cluster/1` (full) or `cluster/2` (compact) object and build a Cluster
    (devices sorted by id)."""
    if not isinstance(obj, dict):
        raise UserError(f"cluster: expected a JSON object, got {type(obj).__name__}")
    fmt = _require(obj, "format", "cluster")
    if fmt not in FORMATS:
        raise UserError(f"cluster.format: expected '{CLUSTER_FORMAT}' (full) or "
                        f"'{COMPACT_FORMAT}' (compact), got {fmt!r}")
    devices = _parse_devices(obj)
    name = checks.text(obj.get("name", "cluster"), "cluster.name", MAX_LABEL_CHARS, empty=True)
    if fmt == COMPACT_FORMAT:
        links = compact_links_from_dict(obj, [d.region for d in devices])
        return Cluster(name, devices, compact=links)
    n = len(devices)
    lat = _parse_matrix(_require(obj, "latency_ms", "cluster"), "latency_ms", n)
    bw = _parse_matrix(_require(obj, "bandwidth_gbps", "cluster"), "bandwidth_gbps", n)
    _check_links(lat, bw)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster(name, devices, lat, bw)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file; raises UserError naming the problem."""
    path = Path(path)
    obj = load_json(path, "cluster file", MAX_CLUSTER_FILE_BYTES)
    try:
        return cluster_from_dict(obj)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write a cluster file atomically, in the form the cluster is in (cluster.to_compact()
    gives the compact one)."""
    atomic_write_json(path, cluster.to_dict())
