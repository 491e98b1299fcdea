"""Built-in clusters: the DT-FM paper's five 64-GPU settings, a heterogeneous `mixed` one, `random`.

Every scenario takes a `seed` that shuffles device ids (so no plan can win by index order);
seed 0 shuffles too. Links inside a site are fast, links between sites are the published figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from formats.cluster import Cluster, Device
from formats.compact import CompactLinks
from formats.errors import UserError
from formats.links import sorted_pairs

# Published peak dense fp16/bf16 tensor-core TFLOP/s and memory (GB) of the GPUs we model.
GPUS: dict[str, tuple[float, float]] = {
    "A100-40GB": (312.0, 40.0),
    "V100-16GB": (112.0, 16.0),  # PCIe V100
    "T4-16GB": (65.0, 16.0),
    # One CPU core running the fp32 runtime (dist_runner on CPU). A nominal figure: the
    # end-to-end benchmark replaces it with the FLOP/s it measures on the machine at hand.
    "CPU": (0.01, 4.0),
}

# DT-FM (Yuan et al., 2022), world-wide setting: measured AWS inter-region (latency ms, Gbit/s).
WORLDWIDE_CITIES = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt",
                    "Ireland")
WORLDWIDE_LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10),
    ("Oregon", "Tokyo"): (96, 0.523), ("Oregon", "Seoul"): (124, 0.46),
    ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482), ("Virginia", "Ohio"): (11, 1.12),
    ("Virginia", "Tokyo"): (143, 0.524), ("Virginia", "Seoul"): (172, 0.500),
    ("Virginia", "London"): (76, 1.16), ("Virginia", "Frankfurt"): (90, 1.02),
    ("Virginia", "Ireland"): (67, 1.05), ("Ohio", "Tokyo"): (130, 0.694),
    ("Ohio", "Seoul"): (159, 0.529), ("Ohio", "London"): (86, 1.05),
    ("Ohio", "Frankfurt"): (99, 0.799), ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36), ("Tokyo", "Ireland"): (199, 0.465),
    ("Seoul", "London"): (238, 0.342), ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335), ("London", "Frankfurt"): (14, 1.14),
    ("London", "Ireland"): (12, 1.09), ("Frankfurt", "Ireland"): (24, 1.08),
}

# DT-FM regional setting: four US regions.
REGIONAL_LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("Virginia", "Oregon"): (67, 1.15), ("Virginia", "California"): (59, 1.05),
    ("Virginia", "Ohio"): (11, 1.12), ("Oregon", "California"): (12, 1.25),
    ("Oregon", "Ohio"): (49, 1.10), ("California", "Ohio"): (52, 1.02),
}

LAB_BANDWIDTH_SCALE = 0.04
"""`lab`: bandwidth of an emulated link per Gbit/s of the regional setting."""

LinkFn = Callable[[int, int], tuple[float, float]]
_STREAM = 0x5CE7A  # keeps scenario draws apart from other users of the same seed


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([_STREAM, seed])


def _devices(regions: list[str], gpus: list[str], seed: int) -> tuple[list[Device], np.ndarray]:
    """Devices from per-slot regions/GPUs, ids shuffled with `seed`: slot k becomes device id
    perm[k]. Returns the devices by id and inv (inv[id] = slot)."""
    n = len(regions)
    perm = _rng(seed).permutation(n)
    inv = np.argsort(perm)  # inv[id] = slot
    counters: dict[str, int] = {}
    devices = []
    for dev_id in range(n):
        slot = int(inv[dev_id])
        region = regions[slot]
        tflops, mem = GPUS[gpus[slot]]
        k = counters.get(region, 0)
        counters[region] = k + 1
        devices.append(Device(dev_id, f"{region.lower()}-{k}", region,
                              f"10.0.{dev_id // 250}.{dev_id % 250 + 1}", gpus[slot], tflops, mem))
    return devices, inv


def _assemble(name: str, regions: list[str], gpus: list[str], link: LinkFn,
              seed: int) -> Cluster:
    """Build a cluster from per-slot regions/GPUs and a (slot, slot) -> (ms, Gbps) function,
    then shuffle ids with `seed`: slot k becomes device id perm[k]."""
    n = len(regions)
    lat = np.zeros((n, n))
    bw = np.full((n, n), np.inf)
    for i, j in itertools.permutations(range(n), 2):
        lat[i, j], bw[i, j] = link(i, j)
    devices, inv = _devices(regions, gpus, seed)
    # Reorder rows/cols from slot order to id order.
    lat, bw = lat[np.ix_(inv, inv)], bw[np.ix_(inv, inv)]
    return Cluster(f"{name}-seed{seed}", devices, lat, bw)


def _assemble_by_region(name: str, regions: list[str], gpus: list[str],
                        table: dict[tuple[str, str], tuple[float, float]], seed: int,
                        compact: bool) -> Cluster:
    """As _assemble for links that depend only on the two regions (`table`, both orders), in
    O(N + regions^2): the compact form, or its N x N expansion (the same matrices)."""
    devices, _ = _devices(regions, gpus, seed)
    names = sorted(set(regions))
    index = {g: k for k, g in enumerate(names)}
    lat, bw = np.full((len(names), len(names)), np.nan), np.full((len(names), len(names)), np.nan)
    for (a, b), (ms, gbps) in table.items():
        if a in index and b in index:
            lat[index[a], index[b]], bw[index[a], index[b]] = ms, gbps
    n = len(devices)
    links = CompactLinks(names, np.array([index[d.region] for d in devices]), lat, bw,
                         np.zeros(n), np.full(n, np.inf), *sorted_pairs([], [], [], [], n))
    cluster = Cluster(f"{name}-seed{seed}", devices, compact=links)
    return cluster if compact else Cluster(cluster.name, devices, *links.classes().dense())


def _sites(region_names: list[str], per_site: int) -> list[str]:
    return [r for r in region_names for _ in range(per_site)]


def _table_link(regions: list[str], table: dict[tuple[str, str], tuple[float, float]],
                inside: tuple[float, float]) -> LinkFn:
    def link(i: int, j: int) -> tuple[float, float]:
        a, b = regions[i], regions[j]
        if a == b:
            return inside
        return table.get((a, b)) or table[(b, a)]
    return link


def datacenter(seed: int = 0) -> Cluster:
    """8 instances x 8 V100: 100 Gbps inside an instance, 3.125 Gbps between (DT-FM case 1)."""
    regions = _sites([f"instance-{k}" for k in range(8)], 8)
    link = lambda i, j: (0.0, 100.0) if regions[i] == regions[j] else (0.0, 3.125)
    return _assemble("datacenter", regions, ["V100-16GB"] * 64, link, seed)


def spot(seed: int = 0) -> Cluster:
    """8 instances x 4 V100 at 100 Gbps inside, 32 standalone V100s, 1.25 Gbps elsewhere."""
    regions = _sites([f"instance-{k}" for k in range(8)], 4) + [f"single-{k}" for k in range(32)]
    link = lambda i, j: (0.0, 100.0) if regions[i] == regions[j] else (0.0, 1.25)
    return _assemble("spot", regions, ["V100-16GB"] * 64, link, seed)


def universities(seed: int = 0) -> Cluster:
    """32 V100 in Ohio, 32 in Virginia: 1 ms / 5 Gbps inside, 11 ms / 1.12 Gbps across."""
    regions = _sites(["Ohio", "Virginia"], 32)
    link = _table_link(regions, {("Ohio", "Virginia"): (11, 1.12)}, (1.0, 5.0))
    return _assemble("universities", regions, ["V100-16GB"] * 64, link, seed)


def regional(seed: int = 0) -> Cluster:
    """16 V100 each in Virginia, Oregon, California, Ohio: 5 ms / 2 Gbps inside a region."""
    regions = _sites(["Virginia", "Oregon", "California", "Ohio"], 16)
    link = _table_link(regions, REGIONAL_LINKS, (5.0, 2.0))
    return _assemble("regional", regions, ["V100-16GB"] * 64, link, seed)


def worldwide(seed: int = 0) -> Cluster:
    """8 V100 in each of 8 cities on 3 continents; AWS inter-region figures from DT-FM."""
    regions = _sites(list(WORLDWIDE_CITIES), 8)
    link = _table_link(regions, WORLDWIDE_LINKS, (5.0, 2.0))
    return _assemble("worldwide", regions, ["V100-16GB"] * 64, link, seed)


def mixed(seed: int = 0) -> Cluster:
    """64 GPUs in 4 regions of the regional setting, each region a mix of A100 / V100 / T4.

    Per region: 4 A100-40GB, 6 V100-16GB, 6 T4-16GB (the A100s of a region share 100 Gbps,
    everything else in a region 2 Gbps / 5 ms; between regions the regional figures).
    """
    names = ["Virginia", "Oregon", "California", "Ohio"]
    per_region = ["A100-40GB"] * 4 + ["V100-16GB"] * 6 + ["T4-16GB"] * 6
    regions = _sites(names, 16)
    gpus = per_region * 4
    base = _table_link(regions, REGIONAL_LINKS, (5.0, 2.0))

    def link(i: int, j: int) -> tuple[float, float]:
        if regions[i] == regions[j] and gpus[i] == gpus[j] == "A100-40GB":
            return 0.0, 100.0
        return base(i, j)
    return _assemble("mixed", regions, gpus, link, seed)


def lab(seed: int = 0) -> Cluster:
    """The regional setting scaled to one machine: 8 CPU ranks, 2 in each of the 4 regions.

    Latencies are the regional ones (2 ms inside a region); bandwidths are the regional Gbit/s
    x 0.04 (40-50 Mbit/s across regions) and 200 Mbit/s inside one, so that gpt-tiny's
    all-reduce and activations weigh on a CPU step about as GPT3-XL's do on 1 Gbps links.
    """
    regions = _sites(["Virginia", "Oregon", "California", "Ohio"], 2)
    scaled = {k: (ms, gbps * LAB_BANDWIDTH_SCALE) for k, (ms, gbps) in REGIONAL_LINKS.items()}
    link = _table_link(regions, scaled, (2.0, 0.2))
    return _assemble("lab", regions, ["CPU"] * 8, link, seed)


BAD_LINK = (40.0, 0.02)
"""`badlink`: latency (ms) and bandwidth (Gbit/s: 20 Mbit/s) of the link between its sites."""


def badlink(seed: int = 0) -> Cluster:
    """8 CPU ranks in two sites of 4 joined by one bad link: 2 ms / 200 Mbit/s inside a site,
    40 ms / 20 Mbit/s across (issue 15: what overlap, fragments and compression are for)."""
    regions = _sites(["site-a", "site-b"], 4)
    link = _table_link(regions, {("site-a", "site-b"): BAD_LINK}, (2.0, 0.2))
    return _assemble("badlink", regions, ["CPU"] * 8, link, seed)


def random_cluster(seed: int = 0, num_devices: int = 64, num_regions: int = 4,
                   gpu_mix: tuple[str, ...] = ("A100-40GB", "V100-16GB", "T4-16GB"),
                   compact: bool = False) -> Cluster:
    """`num_devices` GPUs spread over `num_regions` random regions.

    Inside a region: 1-5 ms, 1-10 Gbps; between regions: 10-150 ms, 0.2-1.5 Gbps (symmetric,
    drawn once per region pair). GPUs drawn uniformly from `gpu_mix`. `compact`: the compact
    form (no N x N matrices: what 10,000 devices need); the same links either way.
    """
    if num_devices < 1 or num_regions < 1:
        raise UserError("random: num_devices and num_regions must be >= 1")
    unknown = [g for g in gpu_mix if g not in GPUS]
    if unknown:
        raise UserError(f"random: unknown GPU types {unknown}; known: {', '.join(GPUS)}")
    rng = _rng(seed)
    region_of = rng.integers(0, num_regions, size=num_devices)
    regions = [f"region-{k}" for k in region_of]
    gpus = [gpu_mix[k] for k in rng.integers(0, len(gpu_mix), size=num_devices)]
    table = {(f"region-{k}", f"region-{k}"): (float(rng.uniform(1, 5)), float(rng.uniform(1, 10)))
             for k in range(num_regions)}
    for a, b in itertools.combinations(range(num_regions), 2):
        link_ab = (float(rng.uniform(10, 150)), float(rng.uniform(0.2, 1.5)))
        table[(f"region-{a}", f"region-{b}")] = table[(f"region-{b}", f"region-{a}")] = link_ab
    return _assemble_by_region(f"random{num_devices}", regions, gpus, table, seed, compact)


SCENARIOS: dict[str, Callable[..., Cluster]] = {
    "datacenter": datacenter,
    "spot": spot,
    "universities": universities,
    "regional": regional,
    "worldwide": worldwide,
    "mixed": mixed,
    "random": random_cluster,
    "lab": lab,
    "badlink": badlink,
}
DTFM_SCENARIOS = ("datacenter", "spot", "universities", "regional", "worldwide")


def make_scenario(name: str, seed: int = 0, **kwargs: int | bool) -> Cluster:
    """Build a named scenario with its ids shuffled by `seed`."""
    try:
        factory = SCENARIOS[name]
    except KeyError:
        raise UserError(f"scenario: unknown name {name!r}; known: {', '.join(SCENARIOS)}") from None
    if seed < 0:
        raise UserError(f"scenario seed: must be >= 0, got {seed}")
    return factory(seed=seed, **kwargs)
