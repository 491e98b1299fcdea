"""Malformed command lines and files for every entry point (tests/test_fuzz_cli.py runs them).

Each Case is a valid command line with one thing broken: a flag's value (nan, inf, 1e999, a
negative count, a 40-digit integer, a directory where a file goes, an address that is not
one, ...) or one field of an input file (a wrong type, a bool or a string where a number goes,
an integer beyond the float range, NaN, a missing key), or a whole file (empty, binary, cut
short, nested 100,000 deep, larger than allowed, a folder). Every case must end with exit
status 2, an `error:` line that names the flag or field (one of `Case.names`), no traceback, and
no file written. The systematic cases are all there; `fuzz_cases(seed)` adds a seeded random
sample of file-field mutations, so a run is reproducible from its seed.

Paths in a case are relative: the runner creates `Case.files` in a fresh folder and runs the
command line there.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SEED = 20240616
"""Seed of the random part (fuzz_cases): fixed, so CI runs the same cases every time."""


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
                     tuple(names) or (flag,), f"{flag} {_short(v)}") for v in values]

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
                text = "deleted" if value is DELETE else _short(value)
                out.append(self.file(name, to_json(mutated(base, path, value)),
                                     names or (str(path[0]),),
                                     f"{_path_text(path)} = {text}"))
        return out


def _short(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text[:20]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 30:
        return f"<{len(str(value))}-digit int>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _path_text(path: Sequence[str | int]) -> str:
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


# ---- per entry point --------------------------------------------------------------------------

def _plan_files(extra: dict[str, Content] | None = None) -> dict[str, Content]:
    return {"c.json": to_json(cluster_dict()), "p.json": to_json(plan_dict()), **(extra or {})}


def scheduler_cases() -> list[Case]:
    """`scheduler.py scenario|plan|evaluate|simulate`."""
    files = _plan_files({"cal.json": to_json(CALIBRATION), "dir": Folder()})
    sc = Scenario("scheduler", ("scenario", "random", "--seed", "0", "--devices", "8",
                                "--regions", "2", "--out", "out.json"), files)
    pl = Scenario("scheduler", ("plan", "--cluster", "c.json", "--model", "gpt-tiny", "--stages",
                                "2", "--replicas", "2", "--objective", "simulated", "--budget",
                                "20", "--random-samples", "2", "--time-limit", "5",
                                "--runtime", "cpu", "--calibration", "cal.json", "--out",
                                "out.json", "--plot", "out.png", "--quiet"), files)
    ev = Scenario("scheduler", ("evaluate", "--cluster", "c.json", "--plan", "p.json",
                                "--objective", "simulated"), files)
    si = Scenario("scheduler", ("simulate", "--cluster", "c.json", "--plan", "p.json",
                                "--timeline", "t.png"), files)
    out = [
        *sc.flag("--seed", BAD_COUNT), *sc.flag("--devices", [*BAD_POSITIVE_COUNT, "1"]),
        *sc.flag("--regions", [*BAD_POSITIVE_COUNT, "9"], ("--regions", "--devices")),
        *sc.flag("--out", ["dir", "c.json/x.json", ""]),
        sc.argv_case(("scenario", "nope", "--out", "out.json"), ("nope",), "unknown scenario"),
        *pl.flag("--stages", [*BAD_COUNT, "3"], ("--stages", "--replicas")),
        *pl.flag("--replicas", [*BAD_COUNT, "3"], ("--stages", "--replicas")),
        *pl.flag("--model", ["gpt-nope", ""], ("--model", "model")),
        *pl.flag("--objective", ["x"]),
        *pl.flag("--micro-batch-size", [*BAD_POSITIVE_COUNT, "10000000000000"]),
        *pl.flag("--micro-batches", [*BAD_COUNT, "10000000000000"]),
        *pl.flag("--tokens-per-replica", POSITIVE),
        *pl.flag("--sync", ["x"]), *pl.flag("--compression", ["int4"]),
        *pl.flag("--inner-steps", [*BAD_POSITIVE_COUNT, "5"], ("--inner-steps", "inner_steps")),
        *pl.flag("--budget", BAD_POSITIVE_COUNT), *pl.flag("--time-limit", POSITIVE),
        *pl.flag("--search-seed", BAD_COUNT), *pl.flag("--random-samples", BAD_POSITIVE_COUNT),
        *pl.flag("--out", ["dir", "c.json/p.json"]), *pl.flag("--plot", ["dir", "p.txt"]),
        *pl.flag("--mfu", [*POSITIVE, "1.5"]), *pl.flag("--activation-bytes", ["3", "x"]),
        *pl.flag("--collective-latency-factor", [*NOT_FINITE, "0.5", "11"]),
        *pl.flag("--outer-store-round-trips", ["-1", "101", "x", "9" * 40]),
        *pl.flag("--recompute", ["yes"]), *pl.flag("--runtime", ["tpu", "gpu"],
                                                    ("--runtime", "runtime")),
        *pl.flag("--calibration", ["missing.json", "dir"],
                 ("--calibration", "missing.json", "dir")),
        pl.argv_case((*pl.argv, "--scenario", "lab"), ("--scenario", "--cluster"),
                     "--cluster and --scenario"),
        pl.argv_case((*pl.argv, "--seed", "1"), ("--seed",), "--seed with --cluster"),
        pl.file("c.json", to_json(cluster_dict(1)), ("device", "--stages", "cluster"),
                "a 1-device cluster"),
        *pl.whole_file("c.json", "--cluster"), *pl.whole_file("cal.json", "--calibration"),
        *pl.json_fields("cal.json", CALIBRATION, CALIBRATION_FIELDS),
        *ev.flag("--objective", ["x"]), *ev.flag("--mfu", NOT_FINITE),
        *ev.whole_file("p.json", "--plan"),
        ev.file("c.json", to_json(cluster_dict(4, memory_gb=0.5)), ("memory",),
                "a plan that does not fit in memory"),
        *si.flag("--timeline", ["dir", "t.txt"]), *si.whole_file("c.json", "--cluster"),
    ]
    return out


def scheduler_plan_field_cases() -> list[Case]:
    """Every PLAN_FIELDS and SIM_CONFIG_FIELDS mutation under `evaluate` and `simulate`."""
    files = _plan_files()
    out = []
    for command in ("evaluate", "simulate"):
        s = Scenario("scheduler", (command, "--cluster", "c.json", "--plan", "p.json"), files)
        out += s.json_fields("p.json", plan_dict(), [*PLAN_FIELDS, *SIM_CONFIG_FIELDS])
    return out


def scheduler_cluster_field_cases() -> list[Case]:
    """Every CLUSTER_FIELDS mutation under `plan` (nothing may be written)."""
    s = Scenario("scheduler", ("plan", "--cluster", "c.json", "--model", "gpt-tiny", "--stages",
                               "2", "--replicas", "2", "--objective", "dtfm", "--budget", "20",
                               "--random-samples", "2", "--out", "out.json", "--quiet"),
                 _plan_files())
    return s.json_fields("c.json", cluster_dict(), CLUSTER_FIELDS)


def dist_runner_cases() -> list[Case]:
    """`dist_runner.py`: every RunConfig/LaunchConfig flag, the plan and cluster files."""
    files = _plan_files({"pd.json": to_json(plan_dict("diloco")), "dir": Folder(),
                         "tiny.txt": b"hello\n", "empty": Folder()})
    s = Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--world-size", "4",
                                 "--dist-url", "tcp://127.0.0.1:29500", "--steps", "2",
                                 "--fake-data", "--metrics", "m.jsonl", "--ckpt-dir", "ck",
                                 "--timeout-s", "5"), files)
    dl = Scenario("dist_runner", with_flag(s.argv, "--plan", "pd.json"), files)
    no_fake = tuple(a for a in s.argv if a != "--fake-data")
    return [
        *s.flag("--steps", BAD_POSITIVE_COUNT), *s.flag("--seed", [*BAD_COUNT, "1" + "0" * 20]),
        *s.flag("--timeout-s", [*POSITIVE, "1e300"]), *s.flag("--log-every", BAD_POSITIVE_COUNT),
        *s.flag("--lr", POSITIVE), *s.flag("--weight-decay", NON_NEGATIVE),
        *s.flag("--warmup-steps", [*BAD_COUNT, "1" + "0" * 20]),
        *s.flag("--lr-schedule", ["x"]), *s.flag("--min-lr-ratio", [*NON_NEGATIVE, "1.5"]),
        *s.flag("--ckpt-every", BAD_COUNT), *s.flag("--keep-checkpoints", BAD_POSITIVE_COUNT),
        *s.flag("--ckpt-dir", ["p.json", "c.json/ck"]),
        *s.flag("--heartbeat-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--eval-every", BAD_COUNT), *s.flag("--eval-sequences", [*BAD_COUNT, "9" * 15]),
        *s.flag("--metrics", ["dir", "c.json/m.jsonl", ""]),
        *s.flag("--peak-tflops", POSITIVE), *s.flag("--device", ["tpu"]),
        *s.flag("--cuda-device", [*BAD_COUNT, "9" * 20]), *s.flag("--comm", ["mpi"]),
        *s.flag("--precision", ["fp8"]), *s.flag("--threads", [*BAD_COUNT, "100000000"]),
        *s.flag("--rank", [*BAD_COUNT, "4"], ("--rank", "rank")),
        *s.flag("--world-size", [*BAD_POSITIVE_COUNT, "3"], ("--world-size", "world size")),
        *s.flag("--dist-url", ["http://127.0.0.1:29500", "tcp://", "tcp://127.0.0.1",
                               "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://:29500",
                               "tcp://a..b:29500", "tcp://127.0.0.1:x"]),
        *s.flag("--cluster", ["missing.json", "dir"], ("--cluster", "missing.json", "dir")),
        *s.flag("--coordinator", ["tcp://127.0.0.1:0", "http://x:1", "tcp://a..b:1"]),
        *s.flag("--debug-vanish", ["x", "1", "-1:2"]),
        s.argv_case(with_flag((*s.argv, "--resume"), "--ckpt-dir", None), ("--resume",),
                    "--resume without --ckpt-dir"),
        s.argv_case((*s.argv, "--join"), ("--join",), "--join on an allreduce plan"),
        s.argv_case((*s.argv, "--data", "tiny.txt"), ("--data", "--fake-data"),
                    "--data and --fake-data"),
        *[s.argv_case((*no_fake, "--data", d), ("data", d), f"--data {d}")
          for d in ("missing.txt", "empty", "tiny.txt")],
        *dl.flag("--replicas", ["a", "-1", "5", "", ",", "0,9"]),
        *dl.flag("--min-replicas", ["0", "-1", "3", "x"]),
        *s.whole_file("p.json", "--plan"),
        *s.json_fields("p.json", plan_dict(), PLAN_FIELDS),
    ]


def dist_runner_cluster_cases() -> list[Case]:
    """`dist_runner.py --cluster`: a broken cluster file."""
    s = Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--dist-url",
                                 "tcp://127.0.0.1:29500", "--steps", "2", "--fake-data",
                                 "--cluster", "c.json", "--metrics", "m.jsonl"), _plan_files())
    return [*s.whole_file("c.json", "--cluster"),
            *s.json_fields("c.json", cluster_dict(), CLUSTER_FIELDS)]


def launch_local_cases() -> list[Case]:
    """`scripts/launch_local.py`: its flags, the plan, the netns map, dist_runner's flags."""
    files = _plan_files({"nm.json": to_json(NETNS_MAP), "dir": Folder()})
    s = Scenario("launch_local", ("--plan", "p.json", "--host", "127.0.0.1", "--port", "0",
                                  "--threads-per-rank", "1", "--grace-s", "1", "--",
                                  "--steps", "1", "--fake-data", "--metrics", "m.jsonl"), files)
    nm = Scenario("launch_local", with_flag(s.argv, "--netns-map", "nm.json"), files)
    return [
        *s.flag("--host", [*BAD_HOST, "192.0.2.1"]), *s.flag("--port", BAD_PORT),
        *s.flag("--threads-per-rank", [*BAD_COUNT, "100000000"]),
        *s.flag("--grace-s", NON_NEGATIVE), *s.flag("--gloo-ifname", ["", "a/b", "x" * 16]),
        *s.flag("--netns-map", ["missing.json", "dir"]),
        *s.whole_file("p.json", "--plan"),
        *nm.whole_file("nm.json", "--netns-map"),
        *nm.json_fields("nm.json", NETNS_MAP, NETNS_MAP_FIELDS),
        *[s.argv_case((*s.argv, *extra), names, f"dist_runner args {' '.join(extra)}")
          for extra, names in ((("--lr", "nan"), ("--lr",)), (("--bogus",), ("--bogus",)),
                               (("--steps", "0"), ("--steps",)),
                               (("--metrics", "dir"), ("--metrics",)),
                               (("--rank", "1"), ("--rank",)))],
    ]


def local_cluster_cases() -> list[Case]:
    """`scripts/local_cluster.py up|probe|status|down`."""
    files = _plan_files({"dir": Folder(), "afile": b"x"})
    up = Scenario("local_cluster", ("up", "--cluster", "c.json", "--hosts", "2", "--group-by",
                                    "modulo", "--link-gbps", "10", "--delay", "auto",
                                    "--out-dir", "od", "--prefix", "fz"), files)
    pr = Scenario("local_cluster", ("probe", "--prefix", "fz", "--seconds", "1", "--pings", "3",
                                    "--out", "m.json"), files)
    return [
        *up.flag("--prefix", ["", "A", "x" * 20, "1a", "a-b", "a/b"]),
        *up.flag("--hosts", [*BAD_POSITIVE_COUNT, "5"]),
        *up.flag("--link-gbps", [*POSITIVE, "1e-9", "0.0001"], ("--link-gbps",)),
        *up.flag("--group-by", ["x"]), *up.flag("--delay", ["x"]),
        *up.flag("--out-dir", ["afile", "afile/sub"]),
        *up.whole_file("c.json", "--cluster"),
        *pr.flag("--seconds", POSITIVE), *pr.flag("--pings", BAD_POSITIVE_COUNT),
        *pr.flag("--out", ["dir", "afile/m.json"]),
        *[Case("local_cluster", (cmd, "--prefix", p), files, ("--prefix",), f"{cmd} {p!r}")
          for cmd in ("status", "down") for p in ("", "UP", "a/b")],
    ]


def tc_cases() -> list[Case]:
    """`scripts/tc.py apply|show|reset|probe`, over SSH and --local."""
    files = _plan_files({"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder(),
                         "afile": b"x"})
    s = Scenario("tc", ("apply", "--cluster", "c.json", "--hosts", "ip_list", "--iface", "eth0",
                        "--link-gbps", "10", "--known-hosts", "kh", "--timeout", "5"), files)
    pr = Scenario("tc", ("probe", "--cluster", "c.json", "--hosts", "ip_list", "--known-hosts",
                         "kh", "--seconds", "1", "--out", "m.json"), files)
    lo = Scenario("tc", ("show", "--cluster", "c.json", "--local", "fz"), files)
    return [
        *s.flag("--iface", ["", "a/b", "x" * 16, "a b"]),
        *s.flag("--link-gbps", [*POSITIVE, "0.0001"]),
        *s.flag("--num-hosts", [*BAD_POSITIVE_COUNT, "3", "9" * 30], ("--num-hosts", "--hosts")),
        *s.flag("--group-by", ["x"]), *s.flag("--timeout", POSITIVE),
        *s.flag("--remote-python", ["", "a\nb"]), *s.flag("--key", ["missing", "dir"]),
        *s.flag("--known-hosts", ["dir"]), *s.flag("--delay", ["x"]),
        *pr.flag("--seconds", POSITIVE), *pr.flag("--out", ["dir", "afile/m.json"]),
        s.argv_case(with_flag(s.argv, "--hosts", None), ("--hosts", "--local"),
                    "neither --hosts nor --local"),
        s.argv_case((*s.argv, "--local", "fz"), ("--hosts", "--local"), "--hosts and --local"),
        *lo.flag("--local", ["", "A", "a/b", "x" * 20]),
        *s.whole_file("c.json", "--cluster"),
        *host_list_cases(s, "ip_list", "--hosts"),
        s.file("ip_list", b"root@10.0.0.1\nroot@10.0.0.1\nroot@10.0.0.3\nroot@10.0.0.4\n",
               ("ip_list", "distinct"), "the same address twice"),
        s.file("ip_list", b"root@a.example\nroot@10.0.0.2\nroot@10.0.0.3\nroot@10.0.0.4\n",
               ("ip_list",), "a name, not an IPv4 address"),
    ]


def cluster_ssh_cases() -> list[Case]:
    """`scripts/cluster_ssh.py` and its subcommands."""
    files = {"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder(), "afile": b"x"}
    head = ("--hosts", "ip_list", "--known-hosts", "kh", "--timeout", "5", "--parallel", "4")
    s = Scenario("cluster_ssh", (*head, "run", "--command-timeout", "5", "--", "true"), files)
    st = Scenario("cluster_ssh", (*head, "start", "--name", "job", "--", "sleep", "1"), files)
    co = Scenario("cluster_ssh", (*head, "collect", "logs", "--dest", "got"), files)
    sy = Scenario("cluster_ssh", (*head, "sync", "afile", "--dest", "remote"), files)
    return [
        *s.flag("--timeout", POSITIVE), *s.flag("--parallel", [*BAD_POSITIVE_COUNT, "100000"]),
        *s.flag("--key", ["missing", "dir"]), *s.flag("--known-hosts", ["missing", "dir"]),
        *s.flag("--command-timeout", POSITIVE),
        s.argv_case((*head, "run"), ("command",), "run without a command"),
        *st.flag("--name", ["", "a/b", "x" * 300, "a b", ".."]),
        *st.flag("--run-dir", ["", "a\nb"]),
        st.argv_case((*head, "kill", "--name", "a/b"), ("--name",), "kill --name a/b"),
        *co.flag("--dest", ["afile", ""]),
        sy.argv_case((*head, "sync", "missing", "--dest", "remote"), ("missing",),
                     "sync of a missing path"),
        *sy.flag("--dest", [""]),
        *host_list_cases(s, "ip_list", "--hosts"),
    ]



def measure_cases() -> list[Case]:
    """`scripts/measure.py`: every bad flag is refused before any host is contacted."""
    files = {"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder()}
    s = Scenario("measure", ("--hosts", "ip_list", "--known-hosts", "kh", "--model",
                             "gpt-tiny", "--out", "c.json", "--timeout", "5"), files)
    return [
        *s.flag("--timeout", POSITIVE), *s.flag("--seconds", POSITIVE),
        *s.flag("--connect-timeout", POSITIVE), *s.flag("--bench-seconds", POSITIVE),
        *s.flag("--port", [*BAD_PORT, "0"]), *s.flag("--micro-batch-size", BAD_POSITIVE_COUNT),
        *s.flag("--model", ["gpt-huge", ""]), *s.flag("--out", ["dir"]),
        *s.flag("--key", ["missing", "dir"]), *s.flag("--known-hosts", ["missing", "dir"]),
        *s.flag("--remote-python", ["", "a\nb"]),
        *host_list_cases(s, "ip_list", "--hosts"),
    ]

def generate_tc_cases() -> list[Case]:
    """`scripts/generate_heterogeneous_tc.py` (prints; nothing runs)."""
    files = _plan_files({"ip_list": HOSTS})
    s = Scenario("generate_tc", ("--cluster", "c.json", "--hosts", "ip_list", "--iface", "eth0",
                                 "--link-gbps", "10", "--host-index", "1"), files)
    return [
        *s.flag("--host-index", [*BAD_COUNT, "4", "9" * 30]),
        *s.flag("--num-hosts", [*BAD_POSITIVE_COUNT, "3"], ("--num-hosts", "--hosts")),
        *s.flag("--iface", ["", "a/b", "x" * 16]), *s.flag("--link-gbps", [*POSITIVE, "0.0001"]),
        *s.flag("--group-by", ["x"]),
        *s.whole_file("c.json", "--cluster"), *host_list_cases(s, "ip_list", "--hosts"),
    ]


def coordinator_cases() -> list[Case]:
    """`scripts/coordinator.py`."""
    s = Scenario("coordinator", ("--listen", "127.0.0.1:0", "--plan", "p.json",
                                 "--start-timeout-s", "5"), _plan_files())
    return [*s.flag("--listen", ["127.0.0.1", "127.0.0.1:70000", ":5", "a..b:5",
                                 "127.0.0.1:-1", "127.0.0.1:" + "9" * 30, ""]),
            *s.flag("--start-timeout-s", [*POSITIVE, "1e300"]),
            *s.whole_file("p.json", "--plan")]


def delay_line_cases() -> list[Case]:
    """`scripts/delay_line.py`."""
    s = Scenario("delay_line", ("--delays", '{"10.0.0.2": 20}', "--queue", "4213", "--tag",
                                "fz"), {})
    bad = ["", "x", "[]", '{"x": 1}', '{"10.0.0.2": -1}', '{"10.0.0.2": NaN}',
           '{"10.0.0.2": 1e400}', '{"10.0.0.2": ' + "9" * 400 + "}", '{"10.0.0.2": "1"}',
           '{"10.0.0.2": true}', '{"10.0.0.2": 60001}', "[" * 100_000,
           '{"10.0.0.2": ' + "1" * 5000 + "}", '{"10.0.0.2": {"a": 1}}',
           '{"999.0.0.1": 1}']
    return [*s.flag("--delays", bad), *s.flag("--queue", BAD_PORT[:1] + ["65536", "x", "9" * 30]),
            *s.flag("--tag", ["", "a\nb", "x" * 300])]


def rendezvous_cases() -> list[Case]:
    """`udp_hole_punching_test/rendezvous_server.py`."""
    s = Scenario("rendezvous_server", ("--bind", "127.0.0.1:47811", "--ttl-s", "60",
                                       "--rate-per-s", "50", "--relay-mbit-s", "0", "--token",
                                       "t"), {})
    return [
        *s.flag("--bind", ["127.0.0.1", "127.0.0.1:0", ":3478", "127.0.0.1:70000",
                           "127.0.0.1:65535", "a..b:3478", "127.0.0.1:x",
                           "127.0.0.1:" + "9" * 30, "no-such-host.invalid:3478"]),
        *s.flag("--ttl-s", POSITIVE), *s.flag("--rate-per-s", POSITIVE),
        *s.flag("--relay-mbit-s", NON_NEGATIVE), *s.flag("--token", ["", "x" * 5000]),
    ]


def peer_cases() -> list[Case]:
    """`udp_hole_punching_test/peer.py`."""
    files = {"dir": Folder(), "afile": b"x"}
    s = Scenario("peer", ("--server", "127.0.0.1:47812", "--session", "s1", "--token", "t",
                          "--local-port", "0", "--private-ip", "127.0.0.1", "--no-wireguard",
                          "--result-json", "r.json"), files)
    return [
        *s.flag("--server", ["x", "127.0.0.1:0", "127.0.0.1:70000", "a..b:3478", ":3478",
                             "no-such-host.invalid:3478"]),
        *s.flag("--session", ["", "x" * 5000, "a\nb"]), *s.flag("--token", ["", "x" * 5000]),
        *s.flag("--local-port", BAD_PORT),
        *s.flag("--private-ip", ["not-an-ip", "999.1.1.1", "", "::1"]),
        *s.flag("--register-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--punch-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--low-ttl", ["-1", "256", "x"]), *s.flag("--hold-s", NON_NEGATIVE),
        *s.flag("--result-json", ["dir", "afile/r.json"]),
    ]


def send_recv_cases() -> list[Case]:
    """`udp_hole_punching_test/send_recv_test.py`."""
    s = Scenario("send_recv_test", ("--dist-url", "tcp://127.0.0.1:47813", "--world-size", "2",
                                    "--rank", "0", "--size-mb", "1", "--iters", "2", "--warmup",
                                    "1", "--timeout-s", "5"), {})
    return [
        *s.flag("--dist-url", ["http://x:1", "tcp://", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
                               "tcp://127.0.0.1:70000", "tcp://a..b:1"]),
        *s.flag("--world-size", ["3", "0", "x"]), *s.flag("--rank", ["2", "-1"]),
        *s.flag("--backend", ["mpi"]), *s.flag("--size-mb", [*POSITIVE, "1e12"]),
        *s.flag("--iters", [*BAD_POSITIVE_COUNT, "9" * 12]),
        *s.flag("--warmup", [*BAD_COUNT, "9" * 12]), *s.flag("--seed", ["-1", "9" * 30]),
        *s.flag("--timeout-s", [*POSITIVE, "1e300"]),
    ]


GENERATORS = (scheduler_cases, scheduler_plan_field_cases, scheduler_cluster_field_cases,
              dist_runner_cases, dist_runner_cluster_cases, launch_local_cases,
              local_cluster_cases, tc_cases, cluster_ssh_cases, measure_cases, generate_tc_cases,
              coordinator_cases, delay_line_cases, rendezvous_cases, peer_cases, send_recv_cases)
"""Every systematic case generator."""


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
        files = {**_plan_files(), name: to_json(mutated(base, path, value))}
        text = "deleted" if value is DELETE else _short(value)
        out.append(Case(entry, argv, files, (str(path[0]), *ALIASES.get(str(path[0]), ())),
                        f"random {name}: {_path_text(path)} = {text}"))
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
