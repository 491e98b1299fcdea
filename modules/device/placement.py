"""Where and how a rank computes: device, precision, compile, collective backend, MFU peak.

`resolve_placement` turns the run's DeviceConfig/MetricsConfig into a `Placement` and makes
every check that can fail on this host (no such device, fp16 on CPU, NCCL for CPU ranks, no
working compiler) before any rendezvous, so a bad choice exits 2 at once instead of after the
other ranks have connected. The Trainer holds the Placement and keeps every tensor on
`device`; checkpoints stay CPU tensors (modules.train.checkpoint.snapshot copies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from formats.cluster import Cluster
from formats.errors import UserError
from formats.plan import Plan
from modules.comm.choice import CommOptions
from modules.config import RunConfig
from modules.device.compile import check_compile_available
from modules.device.precision import Precision, make_precision
from modules.device.select import resolve_device, use_device


@dataclass(frozen=True)
class Placement:
    """Where and how this rank computes (the defaults: CPU, fp32, gloo, eager, no MFU)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where model, optimizer state, batches, activations and pseudo-gradients live."""
    precision: Precision = field(default_factory=lambda: Precision("fp32", torch.device("cpu")))
    """Compute dtype of forward/backward and of the activations crossing pipeline links."""
    comm: CommOptions = field(default_factory=CommOptions)
    """Requested collective backend and this rank's device, for the group builder."""
    compile: bool = False
    """torch.compile the stage's module."""
    replica_peak_tflops: float | None = None
    """Sum of the peak TFLOP/s of my replica's devices (None: no MFU figure)."""


def replica_peak_tflops(cfg: RunConfig, plan: Plan, replica: int,
                        cluster: Cluster | None) -> float | None:
    """The peak the replica's MFU divides by: --peak-tflops per device, else the cluster's
    `tflops` of each device of the replica's pipeline, else None."""
    devices = [d for s in range(plan.num_stages) for d in plan.shard_group(replica, s)]
    if cfg.metrics.peak_tflops is not None:
        return cfg.metrics.peak_tflops * len(devices)
    if cluster is None:
        return None
    return float(sum(cluster.devices[d].tflops for d in devices))


def resolve_placement(cfg: RunConfig, plan: Plan, replica: int,
                      cluster: Cluster | None = None) -> Placement:
    """Check the device flags on this host and make the rank's Placement (UserError naming the
    flag otherwise); selects the CUDA device for this process. Call before any rendezvous."""
    dev_cfg = cfg.device
    device = resolve_device(dev_cfg.device, dev_cfg.cuda_device)
    precision = make_precision(dev_cfg.precision, device)
    if dev_cfg.comm == "nccl" and device.type != "cuda":
        raise UserError(f"--comm nccl: NCCL needs CUDA ranks, this rank runs on {device} "
                        "(use --comm gloo, or auto)")
    use_device(device)  # first: the compile probe builds and runs on this rank's device
    if dev_cfg.compile:
        check_compile_available(device)
    return Placement(device=device, precision=precision,
                     comm=CommOptions(backend=dev_cfg.comm, device=str(device)),
                     compile=dev_cfg.compile,
                     replica_peak_tflops=replica_peak_tflops(cfg, plan, replica, cluster))
