"""The `cluster/1` format: devices and the latency/bandwidth matrices between them.

Row i / column j of each matrix is the device whose id is i / j; matrices are directional
(row = sender). Device ids must be exactly 0..N-1 (rank = device id), in any order in the file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.atomic_io import atomic_write_json
from formats.errors import UserError

CLUSTER_FORMAT = "cluster/1"
DEVICE_KEYS = ("id", "name", "region", "host", "gpu", "tflops", "memory_gb")


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


@dataclass
class Cluster:
    """Devices plus directional latency (ms) and bandwidth (Gbit/s) matrices indexed by id."""

    name: str
    devices: list[Device]
    latency_ms: np.ndarray
    """(N, N) one-way latency in milliseconds; row = sender. Diagonal is 0."""
    bandwidth_gbps: np.ndarray
    """(N, N) bandwidth in Gbit/s (1e9 bit/s); row = sender. Diagonal is ignored (0 or inf)."""

    @property
    def num_devices(self) -> int:
        """Number of devices N."""
        return len(self.devices)

    def regions(self) -> list[str]:
        """Region of each device, indexed by id."""
        return [d.region for d in self.devices]

    def to_dict(self) -> dict[str, Any]:
        """The `cluster/1` JSON object."""
        return {
            "format": CLUSTER_FORMAT,
            "name": self.name,
            "devices": [asdict(d) for d in self.devices],
            "latency_ms": _matrix_to_list(self.latency_ms),
            "bandwidth_gbps": _matrix_to_list(self.bandwidth_gbps),
        }

    def sha256(self) -> str:
        """Digest of the canonical JSON, stored in plans to detect a plan/cluster mismatch."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _matrix_to_list(m: np.ndarray) -> list[list[float]]:
    out = np.array(m, dtype=float)
    np.fill_diagonal(out, 0.0)
    return [[round(float(v), 6) for v in row] for row in out]


def _require(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing key '{key}'")
    return obj[key]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _parse_device(raw: Any, index: int) -> Device:
    where = f"devices[{index}]"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in DEVICE_KEYS:
        _require(raw, key, where)
    dev_id = raw["id"]
    if isinstance(dev_id, bool) or not isinstance(dev_id, int):
        raise UserError(f"{where}.id: expected an integer, got {dev_id!r}")
    tflops = _number(raw["tflops"], f"{where}.tflops")
    memory_gb = _number(raw["memory_gb"], f"{where}.memory_gb")
    if not (math.isfinite(tflops) and tflops > 0):
        raise UserError(f"{where}.tflops: must be a positive number, got {raw['tflops']!r}")
    if not (math.isfinite(memory_gb) and memory_gb > 0):
        raise UserError(f"{where}.memory_gb: must be a positive number, got {raw['memory_gb']!r}")
    return Device(dev_id, str(raw["name"]), str(raw["region"]), str(raw["host"]),
                  str(raw["gpu"]), tflops, memory_gb)


def _parse_matrix(raw: Any, field: str, n: int) -> np.ndarray:
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


def _check_links(lat: np.ndarray, bw: np.ndarray) -> None:
    n = lat.shape[0]
    off = ~np.eye(n, dtype=bool)
    for name, m, ok in (
        ("bandwidth_gbps", bw, np.isfinite(bw) & (bw > 0)),
        ("latency_ms", lat, np.isfinite(lat) & (lat >= 0)),
    ):
        bad = np.argwhere(off & ~ok)
        if len(bad):
            i, j = (int(x) for x in bad[0])
            need = "a positive finite number" if name == "bandwidth_gbps" else ">= 0 and finite"
            raise UserError(
                f"{name}[{i}][{j}]: {float(m[i, j])!r} between devices {i} and {j} must be {need}"
                f" ({len(bad)} bad entr{'y' if len(bad) == 1 else 'ies'} in all)"
            )


def cluster_from_dict(obj: Any) -> Cluster:
    """Validate a `cluster/1` object and build a Cluster (devices sorted by id)."""
    if not isinstance(obj, dict):
        raise UserError(f"cluster: expected a JSON object, got {type(obj).__name__}")
    fmt = _require(obj, "format", "cluster")
    if fmt != CLUSTER_FORMAT:
        raise UserError(f"cluster.format: expected '{CLUSTER_FORMAT}', got {fmt!r}")
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
    lat = _parse_matrix(_require(obj, "latency_ms", "cluster"), "latency_ms", n)
    bw = _parse_matrix(_require(obj, "bandwidth_gbps", "cluster"), "bandwidth_gbps", n)
    _check_links(lat, bw)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster(str(obj.get("name", "cluster")), sorted(devices, key=lambda d: d.id), lat, bw)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file; raises UserError naming the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read cluster file {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    try:
        return cluster_from_dict(obj)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write a cluster file atomically."""
    atomic_write_json(path, cluster.to_dict())
