"""Evolutionary search with local search over stage-group partitions (docs/planner.md: Search)."""

from scheduler.search.evolutionary import (
    SearchConfig,
    SearchResult,
    evolutionary_search,
)

__all__ = ["SearchConfig", "SearchResult", "evolutionary_search"]
