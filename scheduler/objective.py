"""The interface between the search and the cost models it minimises.

A candidate is a (R, S) integer array `pipelines` of device ids: row r is replica r's chain of
devices, column s the stage group of stage s. An objective turns a candidate into seconds.
Objectives may choose the layer split themselves (uneven GPUs want uneven stages) and report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class CostBreakdown:
    """The value of an objective for one candidate, with its parts."""

    objective: str
    """Name of the objective (`dtfm`, `simulated`)."""
    cost_s: float
    """The value minimised, in seconds."""
    parts: dict[str, float] = field(default_factory=dict)
    """Named parts in seconds, e.g. `dp_comm_s`, `pp_comm_s`, `compute_s`."""
    stages: list[tuple[int, int]] = field(default_factory=list)
    """Layer range [start, end) of each stage that this cost assumes."""


class Objective(Protocol):
    """A pure cost function over candidates (no I/O); lower is better."""

    name: str

    def cost(self, pipelines: np.ndarray) -> float:
        """Cost in seconds of the (R, S) device-id array; the search's hot path."""
        ...

    def breakdown(self, pipelines: np.ndarray) -> CostBreakdown:
        """Cost with its parts and the layer split it assumes."""
        ...


def batch_costs(objective: Objective, plans: np.ndarray) -> np.ndarray:
    """(B,) costs of (B, R, S) plans: one vectorised call when the objective has `costs`
    (DT-FM), else one `cost` call per plan (any objective works; a vectorised one is faster)."""
    many = getattr(objective, "costs", None)
    if many is not None:
        return np.asarray(many(plans), dtype=float)
    return np.array([float(objective.cost(p)) for p in plans], dtype=float)


def vectorised(objective: Objective) -> bool:
    """Whether `batch_costs` scores a batch in one call (then batches are cheap to score
    whole; otherwise a first-improvement loop should stop at its first hit)."""
    return getattr(objective, "costs", None) is not None
