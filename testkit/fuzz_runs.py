"""Malformed input for the corpus, tokenizer, run-folder and sync entry points (added to the
cases of testkit/fuzz_entry_points.py and testkit/fuzz_random.py; tests/test_fuzz_cli.py runs
all).

Covers `dist_runner.py`'s data, run-folder and tracker flags and the plan's sync fields
(overlap, fragments, pipeline compression), `scheduler.py plan --sync auto` and its bounds,
`scheduler.py explain`, `scripts/train_tokenizer.py`, `scripts/prepare_data.py`,
`scripts/plot_run.py` and `scripts/local_cluster.py up --sshd`. The rules are those of
testkit/fuzz.py; the one addition is `Case.may_write` for the token cache's lock file (see
LOCK_LEFT). Each table is a sample: one or two bad values per kind of mistake, not every value.
"""

from __future__ import annotations

import functools
import io
import json

from testkit.fuzz import (
    BAD_POSITIVE_COUNT,
    BIG_INT,
    DELETE,
    WHOLE_FILE_JUNK,
    Case,
    Content,
    Folder,
    Raw,
    Scenario,
    cluster_dict,
    mutated,
    plan_dict,
    short_text,
    to_json,
    with_flag,
)
from testkit.fuzz_random import fuzz_cases

CORPUS = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                 for i in range(80)).encode()
"""A text corpus just large enough for gpt-tiny (2,561 byte tokens: 40 windows of 64)."""
LOCK_LEFT = ("tc", "tc/*.lock")
"""What a corpus error found while tokenizing may leave: the token cache folder and the
`<key>.lock` file ranks take turns on. Lock files stay by design (removing one while another
rank waits on it would let a third build at the same time); a cache file (`<key>.uint8`,
`<key>.json`) must not be left."""
WHOLE_FILE_SAMPLE = ("empty file", "binary", "nested 100000 deep", "a folder", "truncated JSON")
"""The WHOLE_FILE_JUNK kinds tried on the files of the new entry points (a sample)."""
NOT_A_TOKENIZER: list[tuple[str, Content]] = [
    ("a plan, not a tokenizer", to_json(plan_dict())),
    ("a JSON object without a model", b'{"version": "1.0"}'),
    ("a BPE model with a string vocab",
     b'{"version": "1.0", "model": {"type": "BPE", "vocab": "x", "merges": []}}'),
    ("an empty file", b""),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\xff"),
    ("UTF-16", '{"version": "1.0"}'.encode("utf-16")),
]
"""Files given as --tokenizer that are not Hugging Face tokenizers files."""


def _whole_file_sample() -> list[tuple[str, Content]]:
    return [(label, c) for label, c in WHOLE_FILE_JUNK if label in WHOLE_FILE_SAMPLE]


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@functools.cache
def parquet(column: str, values: tuple) -> bytes:
    """A parquet file with one column (written with pyarrow, in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({column: list(values)}), buf)
    return buf.getvalue()


@functools.cache
def empty_tokenizer() -> bytes:
    """A valid tokenizers file with no vocabulary at all."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.BPE()).to_str().encode()


def corpus_content_cases(s: Scenario, data_flag: str) -> list[Case]:
    """--data pointing at corpora that are wrong inside (found while reading them)."""
    text = CORPUS.decode().splitlines()
    good = _jsonl([{"text": t} for t in text])
    bad: list[tuple[str, dict[str, Content], tuple[str, ...]]] = [
        ("an empty .txt", {"x.txt": b""}, ("data", "--data")),
        ("an empty .jsonl", {"x.jsonl": b""}, ("data", "--data")),
        ("a .jsonl line that is not JSON", {"x.jsonl": good + b'{"text": "a\n'}, ("x.jsonl:81",)),
        ("a .jsonl line nested 100000 deep", {"x.jsonl": good + b"[" * 100_000 + b"\n"},
         ("x.jsonl:81",)),
        ("a .jsonl text that is a number", {"x.jsonl": good + b'{"text": 5}\n'},
         ("x.jsonl:81",)),
        ("a .jsonl line not UTF-8", {"x.jsonl": b'{"text": "\xff\xfe"}\n'}, ("x.jsonl:1",)),
        ("a .jsonl without the text field", {"x.jsonl": _jsonl([{"body": t} for t in text])},
         ("--text-field",)),
        ("a .parquet without the column", {"x.parquet": parquet("body", tuple(text))},
         ("--text-field",)),
        ("a .parquet column of integers", {"x.parquet": parquet("text", (1, 2, 3))},
         ("'text'",)),
        ("a .parquet that is not parquet", {"x.parquet": b"PAR1 not really"}, ("x.parquet",)),
    ]
    out = []
    for label, files, names in bad:
        name = next(iter(files))
        case = s.argv_case(with_flag(s.argv, data_flag, name), names, f"--data {label}", files)
        out.append(Case(case.entry, case.argv, case.files, case.names, case.label, LOCK_LEFT))
    return out


def corpus_path_cases(s: Scenario, data_flag: str) -> list[Case]:
    """--data naming no usable file (refused before anything is read)."""
    files: dict[str, Content] = {"x.csv": b"a,b\n", "csvdir/x.csv": b"a,b\n",
                                 "emptydir": Folder()}
    values = ["missing.txt", "nomatch-*.txt", "x.csv", "csvdir", "emptydir", ",", "[", ""]
    return [s.argv_case(with_flag(s.argv, data_flag, v), ("data", "--data"),
                        f"--data {v!r}", files) for v in values]


def tokenizer_cases(s: Scenario) -> list[Case]:
    """--tokenizer: missing, a folder, empty, not a tokenizers file, no vocabulary."""
    out = s.flag("--tokenizer", ["missing.json", "dir", "", "BYTES"])
    for label, content in [*NOT_A_TOKENIZER, ("no vocabulary", empty_tokenizer())]:
        out.append(s.argv_case(with_flag(s.argv, "--tokenizer", "tok.json"), ("--tokenizer",),
                               f"--tokenizer {label}", {"tok.json": content}))
    return out


def token_cache_cases(s: Scenario) -> list[Case]:
    """--token-cache: a file, a path under a file, a folder root cannot write in."""
    return s.flag("--token-cache", ["afile", "afile/tc", "/proc/fuzz-token-cache"])


def _data_files() -> dict[str, Content]:
    return {"c.json": to_json(cluster_dict()), "p.json": to_json(plan_dict()),
            "corpus.txt": CORPUS, "dir": Folder(), "afile": b"x"}


def dist_runner_data_base() -> Scenario:
    """dist_runner.py reading corpus.txt into the token cache tc/."""
    return Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--dist-url",
                                    "tcp://127.0.0.1:29500", "--steps", "2", "--data",
                                    "corpus.txt", "--token-cache", "tc", "--timeout-s", "5"),
                    _data_files())


def dist_runner_data_cases() -> list[Case]:
    """`dist_runner.py` --data/--tokenizer/--text-field/--token-cache (checked before any
    rendezvous)."""
    s = dist_runner_data_base()
    return [*tokenizer_cases(s), *s.flag("--text-field", [""]), *token_cache_cases(s),
            *corpus_path_cases(s, "--data"), *corpus_content_cases(s, "--data")]


def dist_runner_run_dir_base() -> Scenario:
    """dist_runner.py with a run folder and the jsonl tracker."""
    return Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--dist-url",
                                    "tcp://127.0.0.1:29500", "--steps", "2", "--fake-data",
                                    "--run-dir", "run", "--tracker", "jsonl", "--timeout-s",
                                    "5"), _data_files())


def dist_runner_run_dir_cases() -> list[Case]:
    """`dist_runner.py` --run-dir, --tracker, --wandb-mode, --pipeline-compression and the
    DiLoCo schedule's overrides (--fragments, --overlap, --overlap-alpha)."""
    s = dist_runner_run_dir_base()
    no_run_dir = with_flag(s.argv, "--run-dir", None)
    return [
        *s.flag("--run-dir", ["afile", "afile/run", ""]),
        *s.flag("--tracker", ["bogus", "", ",", "jsonl,,tensorboard", "jsonl,jsonl",
                              "jsonl,JSONL", "jsonl;tensorboard", "mlflow,jsonl"]),
        s.argv_case(with_flag(no_run_dir, "--tracker", "jsonl,tensorboard"),
                    ("--tracker", "--run-dir"), "--tracker tensorboard without --run-dir"),
        *s.flag("--wandb-mode", ["", "OFFLINE", "disabled"]),
        *s.flag("--pipeline-compression", ["", "int4", "INT8", "fp16"]),
        *s.flag("--fragments", ["0", "-1", "x", "", "1.5", str(BIG_INT)]),
        *s.flag("--overlap", ["maybe", "", "ON"]),
        *s.flag("--overlap-alpha", ["1.5", "-0.1", "nan", "inf", ""]),
        s.argv_case((*s.argv, "--cluster", "c.json", "--run-dir", "afile"), ("--run-dir",),
                    "--cluster with --run-dir a file (no cluster copy written)"),
    ]


SYNC_FIELDS: list[tuple[tuple, list, tuple]] = [
    (("sync", "overlap"), ["yes", 1, 0, None, [], {}], ("sync.overlap",)),
    (("sync", "fragments"), [0, -1, 3, 1.5, 2.0, "2", True, None, BIG_INT, 2 ** 64],
     ("sync.fragments",)),
    (("pipeline_compression",), ["int4", "", "INT8", 5, None, [], True],
     ("pipeline_compression",)),
]
"""Plan fields of the DiLoCo schedule and the pipeline payload (base: a DiLoCo plan, H = 2)."""
ALLREDUCE_SYNC: list[tuple[str, dict]] = [
    ("overlap with allreduce", {"overlap": True}),
    ("fragments 2 with allreduce", {"fragments": 2}),
    ("overlap and fragments with allreduce", {"overlap": True, "fragments": 1}),
]
"""DiLoCo-only settings on an allreduce plan."""


def sync_plan_files() -> list[tuple[str, bytes, tuple[str, ...]]]:
    """(label, plan file, names) of every bad sync setting."""
    base = plan_dict("diloco")
    out = []
    for path, values, names in SYNC_FIELDS:
        for v in values:
            shown = "deleted" if v is DELETE else short_text(v)
            out.append((f"{'.'.join(map(str, path))} = {shown}", to_json(mutated(base, path, v)),
                        names))
    for label, extra in ALLREDUCE_SYNC:
        plan = plan_dict()
        plan["sync"].update(extra)
        out.append((label, to_json(plan), ("sync.overlap", "sync.fragments")))
    return out


def sync_bases() -> list[Scenario]:
    """`scheduler.py simulate` and `dist_runner.py` of a DiLoCo plan (H = 2)."""
    files = {"c.json": to_json(cluster_dict()), "p.json": to_json(plan_dict("diloco"))}
    return [Scenario("scheduler", ("simulate", "--cluster", "c.json", "--plan", "p.json"), files),
            Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--dist-url",
                                     "tcp://127.0.0.1:29500", "--steps", "2", "--fake-data"),
                     files)]


def sync_field_cases() -> list[Case]:
    """Every bad sync setting under `scheduler.py simulate` and `dist_runner.py`."""
    return [s.file("p.json", content, names, label)
            for s in sync_bases() for label, content, names in sync_plan_files()]


def plan_sync_bases() -> tuple[Scenario, Scenario, Scenario]:
    """`scheduler.py plan` with --sync auto (bounded), diloco (H 4, overlap, 2 fragments,
    bf16 activations) and allreduce."""
    files = {"c.json": to_json(cluster_dict()), "dir": Folder(), "afile": b"x"}
    head = ("plan", "--cluster", "c.json", "--model", "gpt-tiny", "--stages", "2", "--replicas",
            "2", "--objective", "simulated", "--budget", "20", "--random-samples", "2",
            "--time-limit", "5", "--out", "out.json", "--quiet")
    au = Scenario("scheduler", (*head, "--sync", "auto", "--max-inner-steps", "4",
                                "--compression", "int8", "--allow-pipeline-compression",
                                "bf16", "--allreduce-out", "ar.json"), files)
    dl = Scenario("scheduler", (*head, "--sync", "diloco", "--inner-steps", "4", "--fragments",
                                "2", "--overlap", "--pipeline-compression", "bf16"), files)
    ar = Scenario("scheduler", (*head, "--sync", "allreduce"), files)
    return au, dl, ar


def scheduler_sync_flag_cases() -> list[Case]:
    """`scheduler.py plan`: --sync auto and its bounds; overlap, fragments and pipeline
    compression on fixed plans."""
    au, dl, ar = plan_sync_bases()
    return [
        *au.flag("--max-inner-steps", [*BAD_POSITIVE_COUNT, "1000000001"]),
        *au.flag("--allow-pipeline-compression", ["int4", "", "BF16"]),
        *au.flag("--compression", ["int4", ""]), *au.flag("--allreduce-out", ["dir", "afile/x"]),
        *[au.argv_case((*au.argv, *extra), (extra[0],), f"--sync auto with {' '.join(extra)}")
          for extra in (("--inner-steps", "2"), ("--fragments", "2"), ("--overlap",),
                        ("--pipeline-compression", "bf16"))],
        au.argv_case(with_flag(au.argv, "--objective", "dtfm"), ("--objective",),
                     "--sync auto with --objective dtfm"),
        *dl.flag("--fragments", ["0", "-1", "5", "x", "1.5", "9" * 40], ("--fragments",)),
        *dl.flag("--inner-steps", ["0", "-1", "x"], ("--inner-steps", "inner_steps")),
        *dl.flag("--pipeline-compression", ["int4", ""]),
        dl.argv_case(with_flag(dl.argv, "--objective", "dtfm"),
                     ("--pipeline-compression", "--objective"),
                     "--pipeline-compression with --objective dtfm"),
        *[dl.argv_case((*dl.argv, flag, value), (flag,), f"--sync diloco with {flag}")
          for flag, value in (("--max-inner-steps", "8"),
                              ("--allow-pipeline-compression", "int8"),
                              ("--allreduce-out", "ar.json"))],
        *[ar.argv_case((*ar.argv, *extra), (extra[0],), f"--sync allreduce with {' '.join(extra)}")
          for extra in (("--overlap",), ("--fragments", "2"), ("--inner-steps", "2"))],
    ]


def _rank_records(rank: int, replica: int | None, stage: int | None, steps: int = 3,
                  change: dict | None = None) -> list[dict]:
    recs = []
    for k in range(1, steps + 1):
        rec = {"step": k, "rank": rank, "replica": replica, "stage": stage, "step_s": 1.0,
               "compute_s": 0.6, "comm_s": 0.4, "pp_wait_s": 0.2, "bytes_sent": 1000,
               "dp_bytes_sent": 500, "wall_time": 1000.0 + k}
        for key, value in (change or {}).items():
            rec = mutated(rec, (key,), value)
        recs.append(rec)
    return recs


def _metrics_records(steps: int = 3, change: dict | None = None) -> list[dict]:
    recs = []
    for k in range(1, steps + 1):
        rec = {"step": k, "loss": 5.0 - 0.1 * k, "tokens": 128 * k, "tokens_per_s": 100.0,
               "step_s": 1.0, "bytes_sent": 10, "wall_time": 1000.0 + k}
        for key, value in (change or {}).items():
            rec = mutated(rec, (key,), value)
        recs.append(rec)
    return recs


def run_folder(plan: dict | None = None) -> dict[str, Content]:
    """A valid run folder `run/` of plan_dict() (what `dist_runner.py --run-dir run` writes)."""
    plan = plan or plan_dict()
    files: dict[str, Content] = {
        "run/metrics.jsonl": _jsonl(_metrics_records()),
        "run/metrics.r1.jsonl": _jsonl(_metrics_records()),
        "run/plan.json": to_json(plan), "run/cluster.json": to_json(cluster_dict())}
    for r, pipe in enumerate(plan["pipelines"]):
        for s, d in enumerate(pipe):
            files[f"run/ranks/rank{d}.jsonl"] = _jsonl(_rank_records(d, r, s))
    return files


RANK_RECORD_JUNK: list[tuple[str, list]] = [
    ("step_s", ["x", None, Raw("NaN"), BIG_INT, True, -1.0, DELETE]),
    ("compute_s", [Raw("Infinity"), BIG_INT, "0.6", -0.5]),
    ("comm_s", [None, BIG_INT, -0.4]),
    ("replica", [[], {}, 5, "0"]),
    ("stage", [[0], 7]),
    ("step", ["1", None, 1.5]),
]
"""Rank 1's timing records, every one of them with this field broken."""


def explain_base() -> Scenario:
    """`scheduler.py explain` of run_folder()."""
    files = {"p.json": to_json(plan_dict()), "c.json": to_json(cluster_dict()),
             **run_folder(), "dir": Folder(), "afile": b"x"}
    return Scenario("scheduler", ("explain", "--plan", "p.json", "--metrics", "run",
                                  "--cluster", "c.json"), files)


def explain_cases() -> list[Case]:
    """`scheduler.py explain`: missing or foreign run folders, broken per-rank timing."""
    s = explain_base()
    files = s.files
    no_cluster = with_flag(s.argv, "--cluster", None)
    ranks = {k: v for k, v in files.items() if "/ranks/" not in k}
    other = plan_dict()
    other["num_micro_batches"] = 4
    out = [
        *s.flag("--metrics", ["missing", "afile", "dir", ""]),
        Case("scheduler", s.argv, ranks, ("--metrics",), "run folder without per-rank timing"),
        Case("scheduler", s.argv, {k: v for k, v in files.items() if k != "run/ranks/rank3.jsonl"},
             ("--metrics",), "rank 3's timing missing"),
        s.file("run/ranks/rank9.jsonl", _jsonl(_rank_records(9, 0, 0)), ("--metrics",),
               "a rank the plan does not have"),
        s.file("run/plan.json", to_json(other), ("--plan",), "the plan of another run"),
        s.file("run/ranks/rank1.jsonl", _jsonl(_rank_records(1, 0, 1, 1) + _rank_records(
            1, 0, None, 1) + _rank_records(1, 1, 1, 1)), ("--metrics",),
            "rank 1 recorded at three places"),
        Case("scheduler", no_cluster, {k: v for k, v in files.items() if k != "run/cluster.json"},
             ("--cluster",), "no --cluster and no run/cluster.json"),
        *[s.file("run/ranks/rank1.jsonl", c, ("--metrics", "rank"), f"every line {label}")
          for label, c in (("not JSON", b"{\n" * 3), ("a list", b"[]\n" * 3),
                           ("nested 100000 deep", b"[" * 100_000 + b"\n"))],
    ]
    for label, content in _whole_file_sample():
        out.append(Case("scheduler", no_cluster, {**files, "run/cluster.json": content},
                        ("cluster.json",), f"run/cluster.json: {label}"))
        if label != "a folder":  # a folder named plan.json is no plan copy: explain goes on
            out.append(s.file("run/plan.json", content, ("plan.json",), label))
    for key, values in RANK_RECORD_JUNK:
        for v in values:
            shown = "deleted" if v is DELETE else short_text(v)
            out.append(s.file("run/ranks/rank1.jsonl", _jsonl_raw(_rank_records(1, 0, 1,
                              change={key: v})), ("--metrics",), f"rank 1 {key} = {shown}"))
    return out


def _jsonl_raw(records: list[dict]) -> bytes:
    """JSON lines that may hold Raw values (NaN, 400-digit integers)."""
    return b"".join(to_json(r) + b"\n" for r in records)


METRICS_RECORD_JUNK: list[tuple[dict, str]] = [
    ({"loss": "x", "step_s": "x", "tokens_per_s": "x", "bytes_sent": "x"}, "text numbers"),
    ({"loss": Raw("NaN"), "tokens_per_s": Raw("NaN"), "bytes_sent": Raw("NaN")}, "NaN"),
    ({"tokens": BIG_INT, "loss": BIG_INT, "tokens_per_s": BIG_INT, "bytes_sent": BIG_INT,
      "wall_time": BIG_INT}, "400-digit integers"),
    ({"loss": DELETE, "tokens_per_s": DELETE, "bytes_sent": DELETE}, "no numbers"),
]
"""Every record of every replica with these fields broken: nothing left to plot."""


def plot_run_base() -> Scenario:
    """`scripts/plot_run.py` of run_folder()."""
    return Scenario("plot_run", ("run", "--out", "out.png"),
                    {**run_folder(), "dir": Folder(), "afile": b"x"})


def plot_run_cases() -> list[Case]:
    """`scripts/plot_run.py RUN_DIR [--out PNG]`."""
    s = plot_run_base()
    files = s.files
    only_ranks = {k: v for k, v in files.items() if "metrics" not in k}
    out = [
        *[s.argv_case((d, "--out", "out.png"), ("RUN_DIR",), f"RUN_DIR {d!r}")
          for d in ("missing", "afile", "dir")],
        Case("plot_run", s.argv, only_ranks, ("RUN_DIR",), "RUN_DIR with per-rank timing only"),
        *s.flag("--out", ["dir", "out.txt", "afile/out.png"]),
        *[Case("plot_run", s.argv, {**files, "run/metrics.jsonl": c, "run/metrics.r1.jsonl": c},
               ("RUN_DIR", "metrics.jsonl"), f"metrics.jsonl: {label}")
          for label, c in [*_whole_file_sample(),
                           ("every line cut short", b'{"step": 1, "lo\n' * 3)]],
    ]
    for change, label in METRICS_RECORD_JUNK:
        bad = _jsonl_raw(_metrics_records(change=change))
        out.append(Case("plot_run", s.argv, {**files, "run/metrics.jsonl": bad,
                                             "run/metrics.r1.jsonl": bad},
                        ("RUN_DIR", "metrics.jsonl"), f"every record: {label}"))
    return out


def train_tokenizer_base() -> Scenario:
    """`scripts/train_tokenizer.py` on corpus.txt."""
    return Scenario("train_tokenizer", ("--data", "corpus.txt", "--vocab-size", "300", "--out",
                                        "tok.json"), _data_files())


def train_tokenizer_cases() -> list[Case]:
    """`scripts/train_tokenizer.py --data CORPUS --vocab-size N --out tokenizer.json`."""
    s = train_tokenizer_base()
    content = [Case(c.entry, c.argv, c.files, c.names, c.label)  # trains in memory: no cache
               for c in corpus_content_cases(s, "--data")]
    return [*s.flag("--vocab-size", [*BAD_POSITIVE_COUNT, "256", "1048577"]),
            *s.flag("--out", ["dir", "tok.txt", "afile/tok.json", ""]),
            *s.flag("--text-field", [""]), *corpus_path_cases(s, "--data"), *content]


def prepare_data_base() -> Scenario:
    """`scripts/prepare_data.py` of corpus.txt into tc/."""
    return Scenario("prepare_data", ("--data", "corpus.txt", "--tokenizer", "bytes",
                                     "--token-cache", "tc"), _data_files())


def prepare_data_cases() -> list[Case]:
    """`scripts/prepare_data.py --data CORPUS --tokenizer T --token-cache DIR`."""
    s = prepare_data_base()
    return [*tokenizer_cases(s), *s.flag("--text-field", [""]), *token_cache_cases(s),
            *corpus_path_cases(s, "--data"), *corpus_content_cases(s, "--data")]


def local_cluster_sshd_base() -> Scenario:
    """`scripts/local_cluster.py up --sshd key.pub`."""
    files = {"c.json": to_json(cluster_dict()), "dir": Folder(), "key.pub": b"ssh-ed25519 AAAA"}
    return Scenario("local_cluster", ("up", "--cluster", "c.json", "--hosts", "2", "--out-dir",
                                      "od", "--prefix", "fz", "--sshd", "key.pub"), files)


def local_cluster_sshd_cases() -> list[Case]:
    """`scripts/local_cluster.py up --sshd KEYS`: refused before any namespace exists."""
    s = local_cluster_sshd_base()
    return s.flag("--sshd", ["missing.pub", "dir", "", "key.pub/x"])


GENERATORS = (dist_runner_data_cases, dist_runner_run_dir_cases, sync_field_cases,
              scheduler_sync_flag_cases, explain_cases, plot_run_cases, train_tokenizer_cases,
              prepare_data_cases, local_cluster_sshd_cases)
"""Every generator of this module."""


def base_scenarios() -> list[Scenario]:
    """The valid command lines the cases of this module break (each must be accepted: run to
    the end, or reach the step that acts), so a case fails for its own mistake only."""
    return [dist_runner_data_base(), dist_runner_run_dir_base(), *sync_bases(),
            *plan_sync_bases(), explain_base(), plot_run_base(), train_tokenizer_base(),
            prepare_data_base(), local_cluster_sshd_base()]


def all_cases(seed: int) -> list[Case]:
    """testkit/fuzz_entry_points.py's and fuzz_random.py's cases (systematic and seeded random)
    and this module's."""
    return [*fuzz_cases(seed), *(c for gen in GENERATORS for c in gen())]

