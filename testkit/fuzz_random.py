"""Seeded random file-field mutations, and `fuzz_cases`: every systematic case plus them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from testkit.fuzz import (
    BIG_INT,
    DEFAULT_SEED,
    DELETE,
    Case,
    cluster_dict,
    mutated,
    path_text,
    plan_dict,
    plan_files,
    short_text,
    to_json,
)
from testkit.fuzz_entry_points import GENERATORS

ALIASES = {"pipelines": ("num_replicas", "num_stages"), "stages": ("num_stages",)}
"""Fields whose breakage a message may report through a field that must agree with them."""
REQUIRED = {"format", "model", "stages", "pipelines", "layers", "devices", "latency_ms",
            "bandwidth_gbps", "id", "name", "region", "host", "gpu", "tflops", "memory_gb"}
"""Keys whose removal is an error (the others have defaults)."""
FREE_FORM = {"cluster", "cluster_sha256", "predicted", "search", "name"}
"""Top-level keys that are records or labels, not settings (left to the systematic cases)."""


def random_file_cases(seed: int, count: int) -> list[Case]:
    """`count` seeded random mutations: a random field of a plan or cluster file set to a
    random value of another type or out of range (or a required key deleted), under a random
    reader."""
    rng = random.Random(seed)
    readers = [("evaluate", "p.json", plan_dict()), ("simulate", "c.json", cluster_dict()),
               ("dist_runner", "p.json", plan_dict())]
    out = []
    while len(out) < count:
        command, name, base = rng.choice(readers)
        path = _random_path(rng, base)
        if path is None or path[0] in FREE_FORM or _on_diagonal(path):
            continue  # free-form fields take anything; a matrix diagonal is ignored
        value = rng.choice(_junk_for(_get(base, path), path))
        argv = (("--plan", "p.json", "--rank", "0", "--dist-url", "tcp://127.0.0.1:29500",
                 "--steps", "1", "--fake-data") if command == "dist_runner" else
                (command, "--cluster", "c.json", "--plan", "p.json"))
        entry = "dist_runner" if command == "dist_runner" else "scheduler"
        files = {**plan_files(), name: to_json(mutated(base, path, value))}
        text = "deleted" if value is DELETE else short_text(value)
        out.append(Case(entry, argv, files, (str(path[0]), *ALIASES.get(str(path[0]), ())),
                        f"random {name}: {path_text(path)} = {text}"))
    return out


def _junk_for(original: Any, path: tuple) -> list[Any]:
    """Values that are wrong wherever `original` stood: another type, or -1 for a number
    (every count, size, rate and id of our formats is >= 0)."""
    required = isinstance(path[-1], int) or path[-1] in REQUIRED
    if isinstance(original, str):
        pool = [5, None, [], {}, True, float("nan")]
    elif isinstance(original, (int, float)) and not isinstance(original, bool):
        pool = [-1, float("nan"), float("inf"), "1", True, None, [], {}, BIG_INT]
    else:
        pool = ["x", 5, None, float("nan"), True]
    return [*pool, DELETE] if required else pool


def _on_diagonal(path: tuple) -> bool:
    return (len(path) == 3 and path[0] in ("latency_ms", "bandwidth_gbps")
            and path[1] == path[2])


def _random_path(rng: random.Random, obj: Any) -> tuple | None:
    path: list[str | int] = []
    while isinstance(obj, (dict, list)) and obj:
        key = rng.choice(list(obj)) if isinstance(obj, dict) else rng.randrange(len(obj))
        path.append(key)
        obj = obj[key]
        if rng.random() < 0.3:
            break
    return tuple(path) or None


def _get(obj: Any, path: Sequence[str | int]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def fuzz_cases(seed: int = DEFAULT_SEED, random_count: int = 100) -> list[Case]:
    """All systematic cases plus `random_count` seeded random file mutations."""
    cases = [c for gen in GENERATORS for c in gen()]
    return cases + random_file_cases(seed, random_count)
