"""The compact form of a cluster's links (`cluster/2`): per region pair, per device, per pair.

A swarm of thousands of devices has few kinds of links, so instead of N x N matrices the file
gives (docs/formats.md):

- `region_links`: `{"regions": [A, B], "latency_ms": x, "bandwidth_gbps": y}` for every pair of
  regions, A to itself included when A has two devices or more; both directions unless
  `"one_way": true` (then A -> B only, row = sender as in the full form);
- `device_links` (optional): `{"device": id, "extra_latency_ms": x, "max_bandwidth_gbps": y}`, a
  device on a slower access line: x is added to every link to and from it, y caps them;
- `pair_links` (optional): `{"devices": [i, j], "latency_ms": x, "bandwidth_gbps": y}`, the exact
  link between two devices (both directions unless `"one_way": true`), over everything above.

`CompactLinks` is that content as arrays; `classes()` turns it into LinkClasses (devices with the
same region and the same access line share a class), from which the N x N matrices are built
only on demand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats import checks
from formats.errors import UserError
from formats.links import LinkClasses, sorted_pairs

COMPACT_FORMAT = "cluster/2"
REGION_LINK_KEYS = {"regions", "latency_ms", "bandwidth_gbps", "one_way"}
DEVICE_LINK_KEYS = {"device", "extra_latency_ms", "max_bandwidth_gbps"}
PAIR_LINK_KEYS = {"devices", "latency_ms", "bandwidth_gbps", "one_way"}
MAX_LATENCY_MS = 1e7
"""Longest link latency accepted (2.8 hours): finite but extreme values (1e308) overflow the
planner's sums and the simulator's step times to inf."""
BANDWIDTH_RANGE_GBPS = (1e-9, 1e9)
"""Slowest and fastest link accepted (1 bit/s to 1 Ebit/s): 5e-324 Gbit/s divides to inf."""
DEVICE_RANGE = (1e-9, 1e9)
"""Range of a device's tflops and memory_gb (1 kFLOP/s to 1 ZFLOP/s, 1 byte to 1 EB)."""


def bound_problem(name: str, x: float) -> str | None:
    """Why a finite link or device value is out of the accepted range (None: it is fine), by
    field name (latency_ms, bandwidth_gbps, tflops, memory_gb and their compact variants)."""
    if "latency" in name:
        lo, hi = 0.0, MAX_LATENCY_MS
    elif "bandwidth" in name:
        lo, hi = BANDWIDTH_RANGE_GBPS
    else:
        lo, hi = DEVICE_RANGE
    if lo <= x <= hi:
        return None
    return f"must be in [{lo:g}, {hi:g}] (a value outside cannot be planned or simulated)"


@dataclass(frozen=True)
class CompactLinks:
    """The links of a compact cluster file, as written."""

    regions: list[str]
    """Region names (sorted); a region's index is its position here."""
    device_region: np.ndarray
    """(N,) int: region index of each device, indexed by device id."""
    latency_ms: np.ndarray
    """(G, G) one-way latency in ms between regions (row = sender); nan where not given."""
    bandwidth_gbps: np.ndarray
    """(G, G) bandwidth in Gbit/s between regions; nan where not given."""
    extra_latency_ms: np.ndarray
    """(N,) ms added to every link to and from each device (0: none)."""
    max_bandwidth_gbps: np.ndarray
    """(N,) Gbit/s cap on every link to and from each device (inf: none)."""
    pair_src: np.ndarray
    """(P,) int: sender of each exact pair link, sorted by (src, dst)."""
    pair_dst: np.ndarray
    """(P,) int: receiver of each exact pair link."""
    pair_latency_ms: np.ndarray
    """(P,) latency of each pair link in ms."""
    pair_bandwidth_gbps: np.ndarray
    """(P,) bandwidth of each pair link in Gbit/s."""

    def classes(self) -> LinkClasses:
        """Link classes: one per (region, extra latency, bandwidth cap) that some device has."""
        key = np.stack([self.device_region.astype(float), self.extra_latency_ms,
                        self.max_bandwidth_gbps], axis=1)
        rows, link_class = np.unique(key, axis=0, return_inverse=True)
        reg, extra, cap = rows[:, 0].astype(np.int64), rows[:, 1], rows[:, 2]
        lat = self.latency_ms[np.ix_(reg, reg)] + extra[:, None] + extra[None, :]
        bw = np.minimum(self.bandwidth_gbps[np.ix_(reg, reg)],
                        np.minimum(cap[:, None], cap[None, :]))
        unused = np.isnan(lat) | np.isnan(bw)  # e.g. a region of one device, to itself
        lat[unused], bw[unused] = 0.0, np.inf
        return LinkClasses(link_class.reshape(-1).astype(np.int64), lat, bw, self.pair_src,
                           self.pair_dst, self.pair_latency_ms, self.pair_bandwidth_gbps)

    def to_dict(self) -> dict[str, Any]:
        """The link keys of the `cluster/2` object: region_links, device_links, pair_links."""
        out: dict[str, Any] = {"region_links": _region_entries(self)}
        devices = [_device_entry(i, float(x), float(y)) for i, (x, y) in
                   enumerate(zip(self.extra_latency_ms, self.max_bandwidth_gbps))
                   if x > 0 or math.isfinite(y)]
        if devices:
            out["device_links"] = devices
        pairs = _pair_entries(self)
        if pairs:
            out["pair_links"] = pairs
        return out


def _link(latency_ms: float, bandwidth_gbps: float) -> dict[str, float]:
    return {"latency_ms": round(float(latency_ms), 6),
            "bandwidth_gbps": round(float(bandwidth_gbps), 6)}


def _region_entries(links: CompactLinks) -> list[dict[str, Any]]:
    lat, bw, names = links.latency_ms, links.bandwidth_gbps, links.regions
    out: list[dict[str, Any]] = []
    for a in range(len(names)):
        for b in range(a, len(names)):
            there = not np.isnan(lat[a, b])
            back = not np.isnan(lat[b, a])
            if there and (a == b or (back and (lat[a, b], bw[a, b]) == (lat[b, a], bw[b, a]))):
                out.append({"regions": [names[a], names[b]], **_link(lat[a, b], bw[a, b])})
                continue
            for x, y, given in ((a, b, there), (b, a, back)):
                if given:
                    out.append({"regions": [names[x], names[y]], **_link(lat[x, y], bw[x, y]),
                                "one_way": True})
    return out


def _device_entry(device: int, extra_ms: float, cap_gbps: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"device": device}
    if extra_ms > 0:
        entry["extra_latency_ms"] = round(extra_ms, 6)
    if math.isfinite(cap_gbps):
        entry["max_bandwidth_gbps"] = round(cap_gbps, 6)
    return entry


def _pair_entries(links: CompactLinks) -> list[dict[str, Any]]:
    given = {(int(s), int(d)): (float(x), float(y)) for s, d, x, y in zip(
        links.pair_src, links.pair_dst, links.pair_latency_ms, links.pair_bandwidth_gbps)}
    out: list[dict[str, Any]] = []
    for (s, d), value in given.items():
        if given.get((d, s)) == value:
            if s < d:  # one entry for both directions
                out.append({"devices": [s, d], **_link(*value)})
            continue
        out.append({"devices": [s, d], **_link(*value), "one_way": True})
    return out


# --------------------------------------------------------------------------- parsing


def _number(value: Any, where: str, positive: bool) -> float:
    """A finite number, > 0 (positive) or >= 0; UserError naming `where` otherwise."""
    x = checks.as_finite(value)  # None: not a number, NaN, infinite, or beyond the float range
    if x is None or not (x > 0 if positive else x >= 0):
        need = "a positive finite number" if positive else "a finite number >= 0"
        raise UserError(f"{where}: must be {need}, got {checks.shown(value)}")
    why = bound_problem(where.rsplit(".", 1)[-1], x)
    if why is not None:
        raise UserError(f"{where}: {why}, got {x!r}")
    return x


def _entries(obj: dict, key: str, allowed: set[str], required: bool) -> list[dict]:
    raw = obj.get(key)
    if raw is None and not required:
        return []
    if not isinstance(raw, list) or (required and not raw):
        raise UserError(f"{key}: expected a {'non-empty ' if required else ''}list of objects, "
                        f"got {raw!r:.60}")
    for k, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise UserError(f"{key}[{k}]: expected an object, got {entry!r:.60}")
        unknown = sorted(set(entry) - allowed)
        if unknown:
            raise UserError(f"{key}[{k}]: unknown keys {unknown}; known: {sorted(allowed)}")
    return raw


def _one_way(entry: dict, where: str) -> bool:
    value = entry.get("one_way", False)
    if not isinstance(value, bool):
        raise UserError(f"{where}.one_way: expected true or false, got {value!r}")
    return value


def _pair_of(entry: dict, key: str, where: str, check: Any) -> tuple[Any, Any]:
    if key not in entry:
        raise UserError(f"{where}: missing key '{key}'")
    pair = entry[key]
    if not isinstance(pair, list) or len(pair) != 2:
        raise UserError(f"{where}.{key}: expected a list of two, got {pair!r:.60}")
    return check(pair[0], f"{where}.{key}[0]"), check(pair[1], f"{where}.{key}[1]")


def _link_values(entry: dict, where: str) -> tuple[float, float]:
    for key in ("latency_ms", "bandwidth_gbps"):
        if key not in entry:
            raise UserError(f"{where}: missing key '{key}'")
    return (_number(entry["latency_ms"], f"{where}.latency_ms", positive=False),
            _number(entry["bandwidth_gbps"], f"{where}.bandwidth_gbps", positive=True))


def _parse_region_links(obj: dict, names: list[str], sizes: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    index = {name: k for k, name in enumerate(names)}

    def region(value: Any, where: str) -> int:
        if not isinstance(value, str) or value not in index:
            raise UserError(f"{where}: unknown region {checks.shown(value)}; the devices' "
                            f"regions are "
                            f"{', '.join(names)}")
        return index[value]

    g = len(names)
    lat, bw = np.full((g, g), np.nan), np.full((g, g), np.nan)
    given_by: dict[tuple[int, int], int] = {}
    for k, entry in enumerate(_entries(obj, "region_links", REGION_LINK_KEYS, required=True)):
        where = f"region_links[{k}]"
        a, b = _pair_of(entry, "regions", where, region)
        values = _link_values(entry, where)
        for x, y in ((a, b),) if _one_way(entry, where) or a == b else ((a, b), (b, a)):
            if (x, y) in given_by:
                raise UserError(f"{where}: regions {names[x]!r} -> {names[y]!r} already given by "
                                f"region_links[{given_by[(x, y)]}]")
            given_by[(x, y)] = k
            lat[x, y], bw[x, y] = values
    needed = [(a, b) for a in range(g) for b in range(g)
              if (a != b or sizes[a] > 1) and (a, b) not in given_by]
    if needed:
        a, b = needed[0]
        raise UserError(f"region_links: no entry for regions {names[a]!r} -> {names[b]!r} "
                        f"({len(needed)} ordered region pair(s) missing in all)")
    return lat, bw


def _device_id(n: int) -> Any:
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise UserError(f"{where}: expected a device id 0..{n - 1}, got {value!r}")
        return value
    return check


def _parse_device_links(obj: dict, n: int) -> tuple[np.ndarray, np.ndarray]:
    extra, cap = np.zeros(n), np.full(n, np.inf)
    seen: dict[int, int] = {}
    for k, entry in enumerate(_entries(obj, "device_links", DEVICE_LINK_KEYS, required=False)):
        where = f"device_links[{k}]"
        if "device" not in entry:
            raise UserError(f"{where}: missing key 'device'")
        dev = _device_id(n)(entry["device"], f"{where}.device")
        if dev in seen:
            raise UserError(f"{where}.device: device {dev} already given by "
                            f"device_links[{seen[dev]}]")
        seen[dev] = k
        if not {"extra_latency_ms", "max_bandwidth_gbps"} & set(entry):
            raise UserError(f"{where}: give extra_latency_ms, max_bandwidth_gbps or both")
        if "extra_latency_ms" in entry:
            extra[dev] = _number(entry["extra_latency_ms"], f"{where}.extra_latency_ms", False)
        if "max_bandwidth_gbps" in entry:
            cap[dev] = _number(entry["max_bandwidth_gbps"], f"{where}.max_bandwidth_gbps", True)
    return extra, cap


def _parse_pair_links(obj: dict, n: int) -> tuple[np.ndarray, ...]:
    given: dict[tuple[int, int], tuple[int, float, float]] = {}
    for k, entry in enumerate(_entries(obj, "pair_links", PAIR_LINK_KEYS, required=False)):
        where = f"pair_links[{k}]"
        i, j = _pair_of(entry, "devices", where, _device_id(n))
        if i == j:
            raise UserError(f"{where}.devices: a link joins two different devices, got [{i}, {j}]")
        lat, bw = _link_values(entry, where)
        for x, y in ((i, j),) if _one_way(entry, where) else ((i, j), (j, i)):
            if (x, y) in given:
                raise UserError(f"{where}: devices {x} -> {y} already given by "
                                f"pair_links[{given[(x, y)][0]}]")
            given[(x, y)] = (k, lat, bw)
    src = np.array([x for x, _ in given], dtype=np.int64)
    dst = np.array([y for _, y in given], dtype=np.int64)
    lat = np.array([v[1] for v in given.values()], dtype=float)
    bw = np.array([v[2] for v in given.values()], dtype=float)
    return sorted_pairs(src, dst, lat, bw, n)


def compact_links_from_dict(obj: dict, device_regions: list[str]) -> CompactLinks:
    """Validate the link keys of a `cluster/2` object for devices in these regions (by id)."""
    for key in ("latency_ms", "bandwidth_gbps"):
        if key in obj:
            raise UserError(f"{key}: a {COMPACT_FORMAT} (compact) file gives its links as "
                            f"region_links, device_links and pair_links, not matrices")
    names = sorted(set(device_regions))
    index = {name: k for k, name in enumerate(names)}
    device_region = np.array([index[r] for r in device_regions], dtype=np.int64)
    sizes = np.bincount(device_region, minlength=len(names))
    lat, bw = _parse_region_links(obj, names, sizes)
    n = len(device_regions)
    extra, cap = _parse_device_links(obj, n)
    return CompactLinks(names, device_region, lat, bw, extra, cap, *_parse_pair_links(obj, n))


# --------------------------------------------------------------------------- from matrices


def compact_links_from_matrices(device_regions: list[str], latency_ms: np.ndarray,
                                bandwidth_gbps: np.ndarray) -> CompactLinks:
    """The compact form of full matrices: per region pair the most common link, every other
    link as an exact pair link (so the expansion gives back the same matrices)."""
    names = sorted(set(device_regions))
    index = {name: k for k, name in enumerate(names)}
    region = np.array([index[r] for r in device_regions], dtype=np.int64)
    n, g = len(region), len(names)
    members = [np.flatnonzero(region == k) for k in range(g)]
    lat_t, bw_t = np.full((g, g), np.nan), np.full((g, g), np.nan)
    off = ~np.eye(n, dtype=bool)
    odd = np.zeros((n, n), dtype=bool)
    for a in range(g):
        for b in range(g):
            block = np.ix_(members[a], members[b])
            used = off[block]
            if not used.any():
                continue
            pairs = np.stack([latency_ms[block][used], bandwidth_gbps[block][used]], axis=1)
            values, counts = np.unique(pairs, axis=0, return_counts=True)
            lat_t[a, b], bw_t[a, b] = values[int(np.argmax(counts))]
            odd[block] = used & ((latency_ms[block] != lat_t[a, b])
                                 | (bandwidth_gbps[block] != bw_t[a, b]))
    src, dst = np.nonzero(odd)
    return CompactLinks(names, region, lat_t, bw_t, np.zeros(n), np.full(n, np.inf),
                        *sorted_pairs(src, dst, latency_ms[src, dst], bandwidth_gbps[src, dst],
                                      n))
