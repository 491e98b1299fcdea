"""The published DT-FM communication cost (Yuan et al., NeurIPS 2022), as a pure function of a plan.

For a candidate `pipelines` (R replicas x S stages of device ids), with t(i, j, x) =
latency_ms[i, j] / 1e3 + x * 8 / bandwidth_gbps[i, j] seconds to send x GB from i to j:

- DP cost of stage group g = max over its devices i of sum over the other members j of
  2 * t(i, j, gradient_gb / R); DP = max over the S stage groups (they sync in parallel).
- PP edge between stage s and s+1 = bottleneck (max over replicas) of t along the plan's own
  chains; PP = sum over the S-1 edges. Total = DP + 2 * PP. For asymmetric matrices the two
  directions are counted separately (forward s -> s+1 plus backward s+1 -> s), which equals
  2 * PP when the matrices are symmetric.

Cost of one evaluation: O(S R^2) with numpy gathers on (N, N) matrices, or, for a compact
cluster of more than link_costs.DENSE_LIMIT devices, O(S R + S K^2) from the K link classes
(group sums from class counts; the exceptions by pair added on top): the same numbers without
the N x N matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.cluster import Cluster
from formats.errors import UserError
from formats.models import ModelSpec
from scheduler.link_costs import DenseCosts, LinkCosts, by_class, class_costs
from scheduler.objective import CostBreakdown

GPT3_XL_PARAMS = 1.3e9
"""The published nominal GPT3-XL size DT-FM uses for gradient bytes."""
DTFM_TOKENS_PER_REPLICA = 1.25e5
"""Tokens per replica per step in the DT-FM setting (61 sequences of 2048)."""


@dataclass(frozen=True)
class DtfmConstants:
    """Bytes the DT-FM cost model moves, in its published units."""

    gradient_gb: float
    """fp32 gradient of one stage, GB = 1e9 bytes."""
    activation_gb: float
    """fp16 activations crossing one stage boundary per step, in GiB (the published unit)."""


def dtfm_constants(model: ModelSpec, num_stages: int,
                   sequences_per_replica: float) -> DtfmConstants:
    """The published constants for gpt3-xl, or the same formula with the model's own sizes.

    gpt3-xl: gradient = 1.3e9 params x 4 bytes / S (0.65 GB for S = 8); activation =
    2024 x 2048 x 2 bytes x (1.25e5 / 2048) / 2^30 = 0.4713 (the published figure, which uses
    2024 for the hidden size), independent of the batch argument.
    """
    if num_stages < 1:
        raise UserError(f"stages: must be >= 1, got {num_stages}")
    if model.name == "gpt3-xl":
        grad = GPT3_XL_PARAMS * 4 / num_stages / 1e9
        act = 2024 * 2048 * 2 * (DTFM_TOKENS_PER_REPLICA / 2048) / 2**30
        return DtfmConstants(grad, act)
    grad = model.total_params() * 4 / num_stages / 1e9
    act = model.activation_bytes_per_sequence(2) * sequences_per_replica / 2**30
    return DtfmConstants(grad, act)


def even_stages(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers as evenly as possible, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise UserError(f"stages: {num_stages} stages cannot split {num_layers} layers "
                        f"(need 1 <= stages <= layers)")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class DtfmObjective:
    """The DT-FM objective for a fixed cluster, model and S x R shape."""

    name = "dtfm"

    def __init__(self, cluster: Cluster, model: ModelSpec, num_stages: int, num_replicas: int,
                 sequences_per_replica: float = DTFM_TOKENS_PER_REPLICA / 2048,
                 classes: bool | None = None) -> None:
        """`classes`: work from link classes (default: for compact clusters of more than
        DENSE_LIMIT devices) instead of (N, N) matrices."""
        self.cluster, self.model = cluster, model
        self.num_stages, self.num_replicas = num_stages, num_replicas
        self.constants = dtfm_constants(model, num_stages, sequences_per_replica)
        self.stages = even_stages(model.num_layers, num_stages)
        act_gb = self.constants.activation_gb
        grad_gb = self.constants.gradient_gb / num_replicas
        self.act: LinkCosts
        """Seconds per boundary's activations on each link."""
        self.grad: LinkCosts
        """Seconds of the 2 x gradient / R exchange on each link (the DP term per pair)."""
        if by_class(cluster) if classes is None else classes:
            links = cluster.link_classes()
            self.act = class_costs(links, lambda lat, bw: lat / 1e3 + act_gb * 8 / bw)
            self.grad = class_costs(links, lambda lat, bw: 2 * (lat / 1e3 + grad_gb * 8 / bw))
            return
        lat_s = cluster.latency_ms / 1e3
        bw = cluster.bandwidth_gbps
        with np.errstate(divide="ignore"):
            # (N, N) seconds per message; diagonal 0 (a device never sends to itself).
            t_act = lat_s + act_gb * 8 / bw
            t_grad = 2 * (lat_s + grad_gb * 8 / bw)
        np.fill_diagonal(t_act, 0.0)
        np.fill_diagonal(t_grad, 0.0)
        self.act, self.grad = DenseCosts(t_act), DenseCosts(t_grad)

    @property
    def t_act(self) -> np.ndarray:
        """(N, N) seconds per boundary's activations (built from classes when planning by
        class: large)."""
        return self.act.dense()

    @property
    def t_grad(self) -> np.ndarray:
        """(N, N) seconds of the DP exchange per pair (as t_act)."""
        return self.grad.dense()

    def dp_group_costs(self, groups: np.ndarray) -> np.ndarray:
        """DP cost of each stage group; `groups` is (G, R) device ids -> (G,) seconds."""
        return self.grad.member_sums(groups).max(axis=1)

    def pp_edges(self, pipelines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward bottleneck time of each of the S-1 stage boundaries."""
        fwd, bwd = self._edges(np.asarray(pipelines)[None])
        return fwd[0], bwd[0]

    def _dp(self, groups: np.ndarray) -> np.ndarray:
        """(B,) DP cost of (B, S, R) stage groups: its slowest group's."""
        b, s, r = groups.shape
        return self.dp_group_costs(groups.reshape(b * s, r)).reshape(b, s).max(axis=1)

    def _edges(self, plans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, S-1) forward and backward bottleneck of each boundary of (B, R, S) plans."""
        src, dst = plans[:, :, :-1], plans[:, :, 1:]
        return self.act.at(src, dst).max(axis=1), self.act.at(dst, src).max(axis=1)

    def parts(self, plans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B,) DP and (B,) PP (forward + backward) seconds of (B, R, S) plans: the one
        definition of the cost that `cost`, `costs` and `breakdown` all read."""
        dp = self._dp(plans.transpose(0, 2, 1))
        if plans.shape[2] == 1:
            return dp, np.zeros(len(plans))
        fwd, bwd = self._edges(plans)
        return dp, fwd.sum(axis=1) + bwd.sum(axis=1)

    def cost(self, pipelines: np.ndarray) -> float:
        """DP + forward PP + backward PP, in seconds."""
        dp, pp = self.parts(np.asarray(pipelines)[None])
        return float(dp[0] + pp[0])

    def costs(self, plans: np.ndarray) -> np.ndarray:
        """`cost` of each of the (B, R, S) plans at once -> (B,) seconds (the search scores
        its batches of candidates with one call)."""
        dp, pp = self.parts(plans)
        return dp + pp

    def lower_bounds(self, groups: np.ndarray) -> np.ndarray:
        """For (B, S, R) stage groups in pipeline order: (B,) a floor under the cost of every
        way of chaining them (the search skips candidates whose floor is above its best).
        DP is exact (it depends on the groups only); each boundary's forward + backward PP is
        at least the largest round trip of its matched pairs, which no perfect matching of the
        two groups can bring below max(largest row minimum, largest column minimum)."""
        b, s, r = groups.shape
        dp = self._dp(groups)
        if s == 1:
            return dp
        shape = (b, s - 1, r, r)
        src = np.broadcast_to(groups[:, :-1, :, None], shape)
        dst = np.broadcast_to(groups[:, 1:, None, :], shape)
        trip = self.act.at(src, dst) + self.act.at(dst, src)
        floor = np.maximum(trip.min(axis=3).max(axis=2), trip.min(axis=2).max(axis=2))
        return dp + floor.sum(axis=1)

    def breakdown(self, pipelines: np.ndarray) -> CostBreakdown:
        """The cost with its DP and PP parts."""
        dp, pp = (float(x[0]) for x in self.parts(np.asarray(pipelines)[None]))
        return CostBreakdown("dtfm", dp + pp, {"dp_comm_s": dp, "pp_comm_s": pp}, self.stages)
