"""The cluster's link tables and the collectives over them: the all-reduce cost models (the
ring's, gloo's own fp32 one, the runtime's compressed direct one) and the ring each stage group
runs (chosen once per group). Pure: numpy over the cluster's arrays; the step's kernel
(kernel.py) charges a plan's all-reduces with them.

Units: seconds, bytes, bits per second, FLOP/s.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from formats.cluster import Cluster
from formats.models import ModelSpec
from formats.wire import payload_bytes_per_param
from scheduler.simulator.config import SimConfig

RING_CACHE_LIMIT = 200_000
"""Stage groups whose ring a RingTable remembers before it starts over."""
RING_STARTS = 64
"""Greedy rings tried per stage group: one from every device up to this many devices; beyond,
fewer (RING_STARTS^2 / n), so that a big group's ring costs about what a 64-device one does
(a 2,000-device group: 0.1 s instead of 15 s)."""
RING_MIN_STARTS = 8
"""The fewest greedy rings tried in a big group."""
GLOO_SEGMENT_BYTES = 1 << 20
"""The largest segment gloo's ring all-reduce sends at once (gloo::AllreduceOptions'
kMaxSegmentSize, the value torch's gloo backend leaves)."""


class LinkTables:
    """Per-cluster arrays the simulator gathers from: latency (s), bandwidth (bit/s), speeds."""

    def __init__(self, cluster: Cluster, config: SimConfig) -> None:
        self.lat_s = np.array(cluster.latency_ms, dtype=float) / 1e3
        self.bits_per_s = np.array(cluster.bandwidth_gbps, dtype=float) * 1e9
        np.fill_diagonal(self.bits_per_s, np.inf)
        np.fill_diagonal(self.lat_s, 0.0)
        self.sec_per_bit = 1.0 / self.bits_per_s
        """Seconds a link is busy per bit (0 from a device to itself)."""
        self.collective_lat_s = self.lat_s * config.collective_latency_factor
        """Latency each all-reduce step pays on a link (gloo's rendezvous: 2 latencies)."""
        self.flops_per_s = np.array([d.tflops for d in cluster.devices]) * 1e12 * config.mfu
        self.memory_bytes = np.array([d.memory_gb for d in cluster.devices]) * 1e9
        self.region_id = np.unique(np.array(cluster.regions()), return_inverse=True)[1]
        """Region index of each device: a sender's traffic into one region shares a link."""


# --------------------------------------------------------------------------- all-reduces



def ring_step_s(payload_bytes: np.ndarray | float, n: int,
                sec_per_bit: np.ndarray) -> np.ndarray:
    """Seconds a ring link of an n-device all-reduce is busy per step: B/n bytes on the wire."""
    return payload_bytes / n * 8.0 * sec_per_bit


def ring_allreduce_s(step_s: np.ndarray, step_lat_s: np.ndarray, axis: int = -1) -> np.ndarray:
    """Seconds of ring all-reduces whose links (along `axis`, n of them) are busy `step_s` and
    pay `step_lat_s` per step: 2(n-1) steps, each as long as its slowest link,
    = 2(n-1) x max_i(lat_i + B/n * 8 / bw_i). The one formula of every all-reduce here (stage
    groups' rings, the tied-embedding sum of 2 ranks)."""
    step_s, step_lat_s = np.asarray(step_s), np.asarray(step_lat_s)
    n = step_s.shape[axis]
    if n <= 1:  # nothing to exchange
        return np.zeros_like(step_s).sum(axis=axis)
    return 2.0 * (n - 1) * (step_s + step_lat_s).max(axis=axis)


def gloo_allreduce_s(step_s: np.ndarray, lat_s: np.ndarray, payload_bytes: np.ndarray | float,
                     axis: int = -1) -> np.ndarray:
    """Seconds of gloo's ring all-reduce (SimConfig.allreduce_algorithm "gloo") of
    `payload_bytes` B over n ring links (along `axis`) busy `step_s` per B/n (ring_step_s),
    each with one-way latency `lat_s`; `payload_bytes` broadcasts against the other axes.

    gloo::allreduce cuts B into K segments, K the least multiple of n that is at least
    max(B / GLOO_SEGMENT_BYTES, 2n); its reduce-scatter and then its all-gather each send
    M = K (n-1) / n segments over every link, two in flight, and a segment leaves only once
    its receiver announced the buffer, which it does when the segment two before arrived. So
    a link moves a pair of segments every P = max(2 lat + t, 2 t) (t: one segment's
    transfer): the announcement's and the data's latency and one transfer, or two transfers
    back to back once the link is the bottleneck; its first pair waits for the announcement
    and both transfers (2 lat + 2 t), and an odd last segment goes one transfer sooner than a
    pair. A phase lasts as long as its slowest link's chain:
    max over links of (ceil(M/2) - 1) P + 2 lat + 2 t - (M odd) t. Equal to an event-by-event
    replay of gloo's loop on 2,000 random rings of 2-8 members and 1 kB-50 MB
    (tests/test_gloo_allreduce_model.py); 0.99-1.17x gloo's all-reduces measured on the lab's
    links but one (benchmarks/gloo_allreduce.py, docs/simulator.md): it starts every member
    when the last arrives, while early ones announce their buffers early."""
    step_s, lat_s = np.asarray(step_s, dtype=float), np.asarray(lat_s, dtype=float)
    axis = axis % step_s.ndim
    n = step_s.shape[axis]
    reduced = step_s.shape[:axis] + step_s.shape[axis + 1:]
    if n <= 1:  # nothing to exchange
        return np.zeros(reduced)
    payload = np.broadcast_to(np.asarray(payload_bytes, dtype=float), reduced)
    segments = np.ceil(np.maximum(np.ceil(payload / GLOO_SEGMENT_BYTES), 2 * n) / n) * n
    sends = np.expand_dims(segments * (n - 1) / n, axis)  # per link and phase
    seg_s = step_s * n / np.expand_dims(segments, axis)  # one segment's transfer per link
    pair = np.maximum(2.0 * lat_s + seg_s, 2.0 * seg_s)
    chain = ((np.ceil(sends / 2.0) - 1.0) * pair + 2.0 * (lat_s + seg_s)
             - (sends % 2) * seg_s)
    return 2.0 * chain.max(axis=axis)


def runs_gloo_allreduce(config: SimConfig, compression: str = "none") -> bool:
    """Whether an all-reduce with this payload compression is gloo's own fp32 one
    (gloo_allreduce_s) under `config`: compressed payloads go through the runtime's direct
    reduce-scatter and ring all-gather whatever the algorithm."""
    return compression == "none" and config.allreduce_algorithm == "gloo"


def direct_allreduce_s(direct_s: np.ndarray, ring_s: np.ndarray) -> np.ndarray:
    """Seconds of the runtime's compressed (int8/fp16) all-reduce (modules/comm/compressed.py):
    a direct reduce-scatter, every member sending its B/n chunk to every other at once, then
    gloo's ring all-gather of the reduced chunks, n-1 steps = max_k(direct_s) + (n-1) x
    max_i(ring_s). `direct_s` (..., K): each sender's links into each region, latency in (a
    sender's chunks into one region share one link, as in shared_pipeline_busy); `ring_s`
    (..., n): each ring link's step, latency in. Measured on the lab's 8 replicas in 4 regions
    (gpt-tiny int8, 2026-11-26): 1.25-1.29 s a blocking all-reduce, against 1.15 s by this
    model and 1.95 s by the 2(n-1)-step ring it was charged as before."""
    n = ring_s.shape[-1]
    if n <= 1:  # nothing to exchange
        return np.zeros(ring_s.shape[:-1])
    return direct_s.max(axis=-1) + (n - 1) * ring_s.max(axis=-1)


def direct_links(members: np.ndarray, lat_s: np.ndarray, sec_per_bit: np.ndarray,
                 region_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(latency, seconds per bit of one chunk to each), each (n, G) for G regions, of each
    member's direct reduce-scatter link into each region: the largest latency into that region
    and the sum of its members' seconds per bit (one chunk to each goes over that one link);
    0 where a region holds no other member. `lat_s` and `sec_per_bit` have 0 on the diagonal
    (a device to itself: LinkTables')."""
    m = np.asarray(members, dtype=np.int64)
    sub_lat, sub_spb = lat_s[m[:, None], m], sec_per_bit[m[:, None], m]  # (n, n)
    into = region_id[m][None, :] == np.arange(int(region_id.max()) + 1)[:, None]  # (G, n)
    spb = sub_spb @ into.T.astype(float)
    lat = np.where(into[None], sub_lat[:, None, :], 0.0).max(axis=2)
    return lat, spb


def undominated(lat_s: np.ndarray, sec_per_bit: np.ndarray) -> np.ndarray:
    """Indices of the links no other link beats on both latency and seconds per bit: only
    they can be the slowest for some payload (the max over links of lat + bits x spb needs no
    others; a group of n devices in G regions has n x G links, most of them dominated)."""
    keep, best = [], -1.0
    for i in np.lexsort((-sec_per_bit, -lat_s)).tolist():  # latency, then spb, descending
        if sec_per_bit[i] > best:
            keep.append(i)
            best = float(sec_per_bit[i])
    return np.array(keep, dtype=np.int64)


def ring_allreduce_time(lat_s: np.ndarray, bits_per_s: np.ndarray, payload_bytes: float) -> float:
    """Seconds of one ring all-reduce of `payload_bytes` over ring links with these latencies and
    bandwidths (link i: ring[i] -> ring[i+1])."""
    lat_s = np.asarray(lat_s, dtype=float)
    step = ring_step_s(payload_bytes, len(lat_s), 1.0 / np.asarray(bits_per_s, dtype=float))
    return float(ring_allreduce_s(step, lat_s))


def ring_order(group: np.ndarray, lat_s: np.ndarray, bits_per_s: np.ndarray,
               chunk_bytes: float) -> np.ndarray:
    """A ring through `group` with a small bottleneck step time (lat + chunk*8/bw): greedy
    nearest neighbour from every start at once (in groups of more than RING_STARTS devices,
    from RING_STARTS^2 / n evenly spaced starts, at least RING_MIN_STARTS), the ring with the
    smallest bottleneck kept (first start on ties). O(n^3) numpy work for n <= RING_STARTS
    devices, O(RING_STARTS^2 n) beyond."""
    group = np.asarray(group, dtype=np.int64)
    n = len(group)
    if n <= 2:
        return group.copy()
    w = lat_s[np.ix_(group, group)] + chunk_bytes * 8.0 / bits_per_s[np.ix_(group, group)]
    np.fill_diagonal(w, np.inf)
    k = min(n, max(RING_MIN_STARTS, RING_STARTS * RING_STARTS // n))
    starts = np.unique(np.linspace(0, n - 1, k).astype(np.int64)) if k < n else np.arange(n)
    rows = np.arange(len(starts))
    order = np.empty((len(starts), n), dtype=np.int64)
    order[:, 0] = starts
    used = np.zeros((len(starts), n), dtype=bool)  # row k: devices already on ring k
    used[rows, starts] = True
    worst = np.zeros(len(starts))
    for step in range(1, n):
        row = np.where(used, np.inf, w[order[:, step - 1]])
        nxt = row.argmin(axis=1)
        worst = np.maximum(worst, row[rows, nxt])
        used[rows, nxt] = True
        order[:, step] = nxt
    worst = np.maximum(worst, w[order[:, -1], order[:, 0]])
    return group[order[int(np.argmin(worst))]]


def ring_chunk_bytes(model: ModelSpec, num_stages: int, num_replicas: int, compression: str,
                     int8_block: int = 256) -> float:
    """Chunk size the ring order is chosen for: an even stage's payload / R (any split)."""
    per_param = payload_bytes_per_param(compression, int8_block)
    return model.total_params() * per_param / num_stages / max(1, num_replicas)


class Ring(NamedTuple):
    """A stage group's ring and the links it uses (link i: order[i] -> order[i+1])."""

    order: np.ndarray
    lat_s: np.ndarray
    """Latency per all-reduce step of each link (collective latency factor applied; gloo's
    fp32 all-reduce: the one-way latency, gloo_allreduce_s charges its rendezvous)."""
    sec_per_bit: np.ndarray
    direct_lat_s: np.ndarray
    """(K,) the compressed all-reduce's direct reduce-scatter links (direct_links) that can be
    its slowest (undominated): latency (collective latency factor applied); empty for fp32."""
    direct_sec_per_bit: np.ndarray
    """(K,) seconds per bit of one chunk to each member of the link's region, summed."""
    direct_sender: np.ndarray
    """(K,) the device sending on each of those links."""


class RingTable:
    """Rings of stage groups, chosen once per group (the search revisits groups often)."""

    def __init__(self, tables: LinkTables, model: ModelSpec, compression: str,
                 config: SimConfig) -> None:
        self.tables, self.model, self.compression, self.config = tables, model, compression, config
        self.gloo = runs_gloo_allreduce(config, compression)
        """Rings of gloo's fp32 all-reduce: the order and one-way latencies it runs with."""
        self._rings: dict[tuple[int, ...], Ring] = {}

    def ring(self, group: np.ndarray, num_stages: int) -> Ring:
        """The ring of `group` (any order) in a plan of `num_stages` stages."""
        members = sorted(int(d) for d in group)
        key = (num_stages, *members)
        hit = self._rings.get(key)
        if hit is None:
            if len(self._rings) > RING_CACHE_LIMIT:
                self._rings.clear()
            t = self.tables
            link_lat = t.collective_lat_s
            if self.gloo:  # gloo's ranks ascending, each sending to the one below
                order, link_lat = np.array(members[::-1], dtype=np.int64), t.lat_s
            else:
                chunk = ring_chunk_bytes(self.model, num_stages, len(members),
                                         self.compression, self.config.int8_block)
                order = ring_order(np.array(members), t.lat_s, t.bits_per_s, chunk)
            nxt = np.roll(order, -1)
            lat = spb = np.zeros(0)
            sender = np.zeros(0, dtype=np.int64)
            if self.compression != "none":  # fp32 is gloo's ring: no direct links
                lat, spb = direct_links(order, t.collective_lat_s, t.sec_per_bit, t.region_id)
                keep = undominated(lat.ravel(), spb.ravel())  # flat index: sender x region
                sender = order[keep // lat.shape[1]]
                lat, spb = lat.ravel()[keep], spb.ravel()[keep]
            hit = Ring(order, link_lat[order, nxt], t.sec_per_bit[order, nxt],
                       lat, spb, sender)
            self._rings[key] = hit
        return hit
