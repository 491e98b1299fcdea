"""Which host pairs to measure at once: rounds of disjoint pairs (the circle method).

A pair's bandwidth test saturates both hosts' links, so two pairs that share a host must not
run together; pairs that share no host can (on a switched network they share no link). The
circle method (round-robin tournament) puts the N(N-1)/2 pairs into N-1 rounds (N even; N
rounds of (N-1)/2 pairs for odd N, one host resting per round) with every host in at most one
pair per round, which is the fewest rounds possible.
"""

from __future__ import annotations


def pair_rounds(num_hosts: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint (i, j) pairs, i < j, covering every pair of hosts exactly once."""
    ring = list(range(num_hosts)) + ([None] if num_hosts % 2 else [])
    m = len(ring)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ring[k], ring[m - 1 - k]) for k in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs
                       if a is not None and b is not None])
        # host ring[0] stays put, the others turn one place (the "circle")
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [r for r in rounds if r]


def estimate_s(num_hosts: int, pair_s: float) -> float:
    """Wall time of the pair phase when one pair (both directions) takes pair_s seconds."""
    return len(pair_rounds(num_hosts)) * pair_s
