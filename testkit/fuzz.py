"""What a fuzz case is, and what cases are built from: the entry points, valid inputs, bad values.

Each Case is a valid command line with one thing broken: a flag's value (nan, inf, 1e999, a
negative count, a 40-digit integer, a directory where a file goes, an address that is not
one, ...) or one field of an input file (a wrong type, a bool or a string where a number goes,
an integer beyond the float range, NaN, a missing key), or a whole file (empty, binary, cut
short, nested 100,000 deep, larger than allowed, a folder). Every case must end with exit
status 2, an `error:` line that names the flag or field (one of `Case.names`), no traceback, and
no file written. The systematic cases are in testkit/fuzz_entry_points.py (one generator per
entry point); testkit/fuzz_random.py's `fuzz_cases(seed)` adds a seeded random sample of
file-field mutations, so a run is reproducible from its seed. tests/test_fuzz_cli.py runs them.

Paths in a case are relative: the runner creates `Case.files` in a fresh folder and runs the
command line there.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SEED = 20240616
"""Seed of the random part (fuzz_random.fuzz_cases): fixed, so CI runs the same cases every time."""


@dataclass(frozen=True)
class EntryPoint:
    """One command-line program of the project."""

    name: str
    script: str
    """Path from the repository root (what `python SCRIPT ...` runs)."""
    module: str
    """Module whose `main(argv)` the script runs (under formats.errors.run_main)."""


ENTRY_POINTS = {e.name: e for e in (
    EntryPoint("scheduler", "scheduler/scheduler.py", "scheduler.scheduler"),
    EntryPoint("dist_runner", "dist_runner.py", "dist_runner"),
    EntryPoint("launch_local", "scripts/launch_local.py", "scripts.launch_local"),
    EntryPoint("local_cluster", "scripts/local_cluster.py", "scripts.local_cluster"),
    EntryPoint("tc", "scripts/tc.py", "scripts.tc"),
    EntryPoint("cluster_ssh", "scripts/cluster_ssh.py", "scripts.cluster_ssh"),
    EntryPoint("measure", "scripts/measure.py", "scripts.measure"),
    EntryPoint("coordinator", "scripts/coordinator.py", "scripts.coordinator"),
    EntryPoint("delay_line", "scripts/delay_line.py", "scripts.delay_line"),
    EntryPoint("generate_tc", "scripts/generate_heterogeneous_tc.py",
               "scripts.generate_heterogeneous_tc"),
    EntryPoint("train_tokenizer", "scripts/train_tokenizer.py", "scripts.train_tokenizer"),
    EntryPoint("prepare_data", "scripts/prepare_data.py", "scripts.prepare_data"),
    EntryPoint("plot_run", "scripts/plot_run.py", "scripts.plot_run"),
    EntryPoint("rendezvous_server", "udp_hole_punching_test/rendezvous_server.py",
               "udp_hole_punching_test.rendezvous_server"),
    EntryPoint("peer", "udp_hole_punching_test/peer.py", "udp_hole_punching_test.peer"),
    EntryPoint("send_recv_test", "udp_hole_punching_test/send_recv_test.py",
               "udp_hole_punching_test.send_recv_test"),
)}


@dataclass(frozen=True)
class Folder:
    """A folder where the case expects a file (or an empty folder to point a flag at)."""


@dataclass(frozen=True)
class Sparse:
    """A file of `size` zero bytes, made sparse (costs no disk): one too large to accept."""

    size: int


@dataclass(frozen=True)
class Fifo:
    """A named pipe where the case expects a file (opening it to read blocks forever)."""


@dataclass(frozen=True)
class Link:
    """A symbolic link to `target` (e.g. /dev/zero, which never ends, or a missing path)."""

    target: str


Content = bytes | Folder | Sparse | Fifo | Link


@dataclass(frozen=True)
class Case:
    """One malformed invocation."""

    entry: str
    """Key of ENTRY_POINTS."""
    argv: tuple[str, ...]
    files: dict[str, Content] = field(default_factory=dict)
    """Input files (relative path -> content) created before the run."""
    names: tuple[str, ...] = ()
    """The error message must contain one of these (the flag, field or file at fault)."""
    label: str = ""
    """What is wrong, for reports."""
    may_write: tuple[str, ...] = ()
    """fnmatch patterns of paths the case may leave behind (shared bookkeeping such as a lock
    file, never an output; testkit/fuzz_runs.py says which and why)."""

    @property
    def id(self) -> str:
        """A short unique-enough name for reports."""
        return f"{self.entry}: {self.label}"


class Raw:
    """JSON text put into a file verbatim (what json.dumps cannot write, e.g. 5,000 digits)."""

    def __init__(self, text: str) -> None:
        self.text = text


def to_json(obj: Any) -> bytes:
    """json.dumps that writes Raw values verbatim and NaN/Infinity as Python's json does."""
    raws: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(obj))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw)
    return text.encode()


DELETE = object()
"""A mutation value: remove the key."""


def mutated(obj: Any, path: Sequence[str | int], value: Any) -> Any:
    """A deep copy of `obj` with the item at `path` replaced by `value` (or removed: DELETE)."""
    out = copy.deepcopy(obj)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


# ---- valid inputs every case starts from -------------------------------------------------

def cluster_dict(n: int = 4, memory_gb: float = 16.0) -> dict:
    """A valid cluster/1 object: n devices in two regions, hosts 10.0.0.1.., slow links across."""
    devices = [{"id": i, "name": f"d{i}", "region": "ab"[i * 2 // n], "host": f"10.0.0.{i + 1}",
                "gpu": "T4", "tflops": 10.0, "memory_gb": memory_gb} for i in range(n)]
    same = [[d["region"] for d in devices][i] for i in range(n)]
    lat = [[0.0 if i == j else (1.0 if same[i] == same[j] else 20.0) for j in range(n)]
           for i in range(n)]
    bw = [[0.0 if i == j else (1.0 if same[i] == same[j] else 0.1) for j in range(n)]
          for i in range(n)]
    return {"format": "cluster/1", "name": "fuzz", "devices": devices, "latency_ms": lat,
            "bandwidth_gbps": bw}


def plan_dict(mode: str = "allreduce") -> dict:
    """A valid plan/1 object for cluster_dict(4): gpt-tiny, 2 stages x 2 replicas."""
    sync = {"mode": mode, "inner_steps": 2 if mode == "diloco" else 1, "compression": "none",
            "outer_lr": 0.7, "outer_momentum": 0.9}
    return {"format": "plan/1", "cluster": "fuzz", "cluster_sha256": "", "model": "gpt-tiny",
            "num_stages": 2, "num_replicas": 2, "micro_batch_size": 1, "num_micro_batches": 2,
            "stages": [{"layers": [0, 2]}, {"layers": [2, 4]}], "pipelines": [[0, 1], [2, 3]],
            "sync": sync, "predicted": {}, "search": {"sim_config": {"mfu": 0.5}}}


CALIBRATION = {"format": "calibration/1", "runtime": "cpu", "mfu": 0.8, "measured": {}}
HOSTS = b"# fuzz hosts\nroot@10.0.0.1\nroot@10.0.0.2\nroot@10.0.0.3:2222\nroot@10.0.0.4\n"
NETNS_MAP = {"0": "fz-0", "1": "fz-1", "2": "fz-2", "3": "fz-3"}
BIG_INT = 10 ** 400
"""An integer JSON allows and no float can hold."""

# ---- bad values -----------------------------------------------------------------------------

NOT_FINITE = ["nan", "inf", "-inf", "1e999", "NaN", "abc", ""]
POSITIVE = [*NOT_FINITE, "0", "-1", "-1e-300"]
NON_NEGATIVE = [*NOT_FINITE, "-1", "-0.5"]
BAD_INT = ["abc", "1.5", "", "1e3", "nan", "9" * 40, "0x10"]
BAD_COUNT = [*BAD_INT, "-1"]
BAD_POSITIVE_COUNT = [*BAD_COUNT, "0"]
BAD_PORT = ["-1", "65536", "99999999999999999999", "abc", "1.5", ""]
BAD_HOST = ["a..b", "", "no-such-host.invalid", "999.1.1.1", "a b"]
NUMBER_JUNK = [float("nan"), float("inf"), "1", True, None, [], {}, BIG_INT, Raw("-1e999")]
COUNT_JUNK = [0, -1, 1.5, 2.0, "1", True, None, BIG_INT, 2 ** 64]

WHOLE_FILE_JUNK: list[tuple[str, Content]] = [
    ("empty file", b""),
    ("truncated JSON", b'{"format": "'),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff\xfe"),
    ("UTF-16 text", '{"format": 1}'.encode("utf-16")),
    ("a JSON list", b"[]"),
    ("a JSON string", b'"x"'),
    ("JSON null", b"null"),
    ("NaN", b"NaN"),
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000),
    ("nested 100 deep", b'{"a":' * 100 + b"1" + b"}" * 100),
    ("a 5000-digit number", b'{"format": ' + b"7" * 5000 + b"}"),
    ("larger than 64 MiB", Sparse((64 << 20) + 1)),
    ("a folder", Folder()),
]
"""Whole-file corruptions for any JSON input file."""


def with_flag(argv: Sequence[str], flag: str, value: str | None) -> tuple[str, ...]:
    """argv with `flag`'s value replaced (value None: the flag removed; a flag not in argv is
    added before a `--` if there is one, else at the end)."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        if value is None:
            del out[i:i + 2]
        else:
            out[i + 1] = value
        return tuple(out)
    if value is None:
        return tuple(out)
    at = out.index("--") if "--" in out else len(out)
    return tuple(out[:at] + [flag, value] + out[at:])


@dataclass
class Scenario:
    """A valid command line of one entry point with its input files."""

    entry: str
    argv: tuple[str, ...]
    files: dict[str, Content]

    def flag(self, flag: str, values: Iterable[str], names: Sequence[str] = ()) -> list[Case]:
        """One case per bad value of `flag`."""
        return [Case(self.entry, with_flag(self.argv, flag, v), dict(self.files),
                     tuple(names) or (flag,), f"{flag} {short_text(v)}") for v in values]

    def argv_case(self, argv: Sequence[str], names: Sequence[str], label: str,
                  files: dict[str, Content] | None = None) -> Case:
        """A case with a command line of its own (and extra files)."""
        return Case(self.entry, tuple(argv), {**self.files, **(files or {})}, tuple(names),
                    label)

    def file(self, name: str, content: Content, names: Sequence[str], label: str) -> Case:
        """The scenario with input file `name` replaced."""
        return Case(self.entry, self.argv, {**self.files, name: content}, tuple(names),
                    f"{name}: {label}")

    def missing(self, name: str, names: Sequence[str]) -> Case:
        """The scenario with input file `name` absent."""
        files = {k: v for k, v in self.files.items() if k != name}
        return Case(self.entry, self.argv, files, tuple(names), f"{name}: missing")

    def whole_file(self, name: str, flag: str) -> list[Case]:
        """Every WHOLE_FILE_JUNK content as file `name`, and the file missing."""
        return [self.file(name, content, (name, flag), label)
                for label, content in WHOLE_FILE_JUNK] + [self.missing(name, (name, flag))]

    def json_fields(self, name: str, base: Any, table: Sequence[tuple[tuple, list, tuple]]
                    ) -> list[Case]:
        """One case per (path, bad value) of `table`; names default to the path's first key."""
        out = []
        for path, values, names in table:
            for value in values:
                text = "deleted" if value is DELETE else short_text(value)
                out.append(self.file(name, to_json(mutated(base, path, value)),
                                     names or (str(path[0]),),
                                     f"{path_text(path)} = {text}"))
        return out


def short_text(value: Any) -> str:
    """`value` shortened for a case's label."""
    if isinstance(value, Raw):
        return value.text[:20]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 30:
        return f"<{len(str(value))}-digit int>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def path_text(path: Sequence[str | int]) -> str:
    """A field path as a label: `stages[0].layers`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


# ---- file-field tables: (path, bad values, names the message may use) ------------------------

PLAN_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("format",), ["plan/0", None, 1, DELETE], ()),
    (("model",), ["gpt-nope", 5, None, "", DELETE], ()),
    (("stages",), ["x", {}, [], None, [{"layers": [0, 4]}], DELETE,
                   [{"layers": [0, 2]}, {"layers": [2, 5]}],
                   [{"layers": [0, 2]}, {"layers": [1, 4]}]], ("stages", "num_stages")),
    (("stages", 0), [None, [], "x", {"layers": [0]}, {}, {"layers": "02"},
                     {"layers": [0, 2, 3]}], ("stages",)),
    (("stages", 0, "layers", 0), [0.0, 0.5, "0", False, None, -1, BIG_INT, []], ("stages",)),
    (("stages", 1, "layers", 1), [4.0, 3.5, "4", True, None, 99, BIG_INT, {}], ("stages",)),
    (("pipelines",), ["x", {}, [], None, [[0, 1, 2]], [[0], [1]], DELETE, [0, 1, 2, 3]],
     ("pipelines", "num_replicas", "num_stages")),
    (("pipelines", 0), [None, "01", [0], [0, 1, 2], {}], ("pipelines",)),
    (("pipelines", 0, 0), [-1, 1.0, "0", True, None, BIG_INT, 1, [0]], ("pipelines",)),
    (("micro_batch_size",), [*COUNT_JUNK, 10 ** 12], ()),
    (("num_micro_batches",), [*COUNT_JUNK, 10 ** 12], ()),
    (("num_stages",), [3, "2", None, 2.5], ()),
    (("num_replicas",), [1, "2", True], ()),
    (("sync",), ["x", [], None, 5], ()),
    (("sync", "mode"), ["sgd", 5, None, ""], ("sync",)),
    (("sync", "inner_steps"), [0, -1, 2, 1.5, True, "1", BIG_INT, None], ("sync",)),
    (("sync", "compression"), ["int4", None, 8, ""], ("sync",)),
    (("sync", "outer_lr"), [0, -1, *NUMBER_JUNK], ("sync",)),
    (("sync", "outer_momentum"), [1, -0.1, 1.5, *NUMBER_JUNK], ("sync",)),
    (("sync", "bogus"), [1], ("sync",)),
    (("predicted",), ["x", [], 5], ()),
    (("search",), ["x", [], 5, None], ()),
]
SIM_CONFIG_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("search", "sim_config"), ["x", [], 5], ("sim_config",)),
    (("search", "sim_config", "mfu"), [0, 1.5, *NUMBER_JUNK], ("mfu",)),
    (("search", "sim_config", "reserved_gb"), [-1, *NUMBER_JUNK], ("reserved_gb",)),
    (("search", "sim_config", "activation_bytes"), [3, 2.0, "2", True, BIG_INT, None],
     ("activation_bytes",)),
    (("search", "sim_config", "recompute"), ["yes", 1, None, []], ("recompute",)),
    (("search", "sim_config", "runtime"), ["tpu", 5, [], {}], ("runtime",)),
    (("search", "sim_config", "int8_block"), [0, 1.5, BIG_INT, "256", 2 ** 64], ("int8_block",)),
    (("search", "sim_config", "collective_latency_factor"), [0.5, 11, *NUMBER_JUNK],
     ("collective_latency_factor",)),
    (("search", "sim_config", "outer_store_round_trips"), [-1, 101, 1.5, BIG_INT, "3"],
     ("outer_store_round_trips",)),
    (("search", "sim_config", "calibration"), [5, [], {}], ("calibration",)),
]
"""search.sim_config: read by `scheduler.py evaluate/simulate` only."""
CLUSTER_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("format",), ["cluster/0", None, 1, DELETE], ()),
    (("name",), [5, None, [], {}], ()),
    (("devices",), [[], "x", None, {}, DELETE], ()),
    (("devices", 0), ["x", None, [], 5], ("devices",)),
    (("devices", 0, "id"), [-1, 4, 1, 0.0, "0", True, None, BIG_INT, DELETE], ("devices",)),
    (("devices", 1, "tflops"), [0, -1, *NUMBER_JUNK, DELETE], ("devices",)),
    (("devices", 2, "memory_gb"), [0, -1, *NUMBER_JUNK], ("devices",)),
    (("devices", 3, "name"), [5, None, [], {}], ("devices",)),
    (("devices", 0, "region"), [5, None, [], True], ("devices",)),
    (("devices", 1, "host"), [5, None, [], 1.5], ("devices",)),
    (("devices", 2, "gpu"), [5, None, {}], ("devices",)),
    (("latency_ms",), ["x", [], None, [[0.0]], DELETE], ()),
    (("latency_ms", 1), ["x", [0, 1], None, {}], ("latency_ms",)),
    (("latency_ms", 0, 1), [-1, *NUMBER_JUNK], ("latency_ms",)),
    (("bandwidth_gbps", 2, 3), [0, -1, *NUMBER_JUNK], ("bandwidth_gbps",)),
    (("bandwidth_gbps",), [5, [[1, 1], [1, 1]]], ()),
]
CALIBRATION_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("format",), ["calibration/0", None, 5, DELETE], ()),
    (("runtime",), ["tpu", 5, [], {}, "gpu"], ()),
    (("mfu",), [0, 1.5, *NUMBER_JUNK], ()),
    (("activation_bytes",), [3, 2.0, "2", True, BIG_INT, None], ()),
    (("recompute",), ["yes", 1, None, []], ()),
    (("collective_latency_factor",), [0.5, 11, *NUMBER_JUNK], ()),
    (("outer_store_round_trips",), [-1, 101, 1.5, BIG_INT, "3", None], ()),
    (("measured",), ["x", [], 5], ()),
    (("bogus",), [1], ()),
]
NETNS_MAP_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("0",), [5, None, "", "a/b", "x" * 300, [], "..", "a\nb", DELETE], ("netns-map",)),
    (("x",), ["fz-x"], ("netns-map",)),
    (("-1",), ["fz-x"], ("netns-map",)),
]
HOST_LINES = [
    "10.0.0.9", "root@", "@10.0.0.9", "root@10.0.0.9:0", "root@10.0.0.9:70000",
    "root@10.0.0.9:x", "root@[::1", "root@[::1]x", "root@host name", "ro ot@10.0.0.9",
    "root@10.0.0.9:99999999999999999999", "root@10.0.0.9\x00", "root@" + "h" * 300,
    "r" * 300 + "@10.0.0.9", "root@a\x1bb", "root@10.0.0.9:+22", "root@10.0.0.9: 22",
]
"""Host-list lines that are not `user@host[:port]` (each replaces line 2 of HOSTS)."""


def host_list_cases(s: Scenario, name: str, flag: str) -> list[Case]:
    """Bad host lists for the scenario's host-list file `name`."""
    base = HOSTS.decode().splitlines()
    out = [s.file(name, ("\n".join([base[0], base[1], line, *base[3:]]) + "\n").encode(),
                  (name, flag), f"line {line[:30]!r}") for line in HOST_LINES]
    for label, content in (("binary", b"\xff\xfe\x00root@10.0.0.1\n\x80"), ("empty", b""),
                           ("only comments", b"# nothing\n\n"), ("a folder", Folder()),
                           ("larger than 64 MiB", Sparse((64 << 20) + 1))):
        out.append(s.file(name, content, (name, flag), label))
    return [*out, s.missing(name, (name, flag))]


def plan_files(extra: dict[str, Content] | None = None) -> dict[str, Content]:
    """The valid cluster and plan files (c.json, p.json), and `extra`."""
    return {"c.json": to_json(cluster_dict()), "p.json": to_json(plan_dict()), **(extra or {})}
