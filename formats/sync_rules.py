"""The outer-sync rules a plan may name (`sync.mode`), each declared once, with what it implies.

The planner, the simulator and the runtime ask a rule what it does (`rule.local_steps`)
instead of comparing its name, so a new rule is one `register_sync_rule` call plus the code
that is really new (its cost and its runtime), not a hunt for `== "diloco"` in every package.
"""

from __future__ import annotations

from dataclasses import dataclass

from formats.checks import shown
from formats.errors import UserError


@dataclass(frozen=True)
class SyncRule:
    """How the replicas of a stage keep their parameters in step."""

    name: str
    """What `sync.mode` says, and `--sync` on both command lines."""
    summary: str
    """One line for help texts and the docs."""
    local_steps: bool
    """True: replicas take H (`sync.inner_steps`) optimizer steps alone between two syncs and
    average pseudo-gradients through an outer optimizer (DiLoCo), so the rule has H > 1, a
    warm-up, overlap and fragments, an outer state, and replicas may join or leave mid-run.
    False: gradients are averaged every step (all-reduce): H is 1, the replicas never differ
    and the planner's quality model measures every other rule against it."""


_RULES: dict[str, SyncRule] = {}


def register_sync_rule(rule: SyncRule) -> SyncRule:
    """Add a rule plans may name; ValueError when its name is taken."""
    if rule.name in _RULES or rule.name == "auto":
        raise ValueError(f"sync rule {rule.name!r} is already registered (or reserved)")
    _RULES[rule.name] = rule
    return rule


def sync_modes() -> tuple[str, ...]:
    """The names of every registered rule, in registration order."""
    return tuple(_RULES)


def sync_rule(name: str, field: str = "sync.mode") -> SyncRule:
    """The rule a plan names; UserError naming the field and the choices when it is unknown."""
    rule = _RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        raise UserError(f"{field}: {shown(name)} is not one of {', '.join(_RULES)}")
    return rule


def local_step_modes(quote: str = "'") -> str:
    """The rules with local steps, for messages: "'diloco'" (or "diloco" with quote="")."""
    return " or ".join(f"{quote}{r.name}{quote}" for r in _RULES.values() if r.local_steps)


ALLREDUCE = register_sync_rule(SyncRule(
    "allreduce", "average gradients every step (data-parallel all-reduce)", local_steps=False))
DILOCO = register_sync_rule(SyncRule(
    "diloco", "H local steps, then an outer step on the averaged pseudo-gradient (DiLoCo)",
    local_steps=True))
