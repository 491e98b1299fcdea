"""Malformed input of the third reliability pass (added to the cases of
testkit/fuzz_entry_points.py, testkit/fuzz_random.py and testkit/fuzz_runs.py;
tests/test_fuzz_cli.py runs them all).

Classes of input, each generated over every file or flag it applies to:
- special files where a file is read: a FIFO (opening it blocks forever) and a symlink to
  /dev/zero (never ends), for plans, clusters, run folders, tokenizers, corpora and known_hosts;
- finite but extreme cluster values (1e308, 5e-324, ...) in every link and device field, in the
  full (cluster/1) and the compact (cluster/2) form;
- tokenizers that fail while encoding (WordLevel without unk_token);
- parquet corpora with two text columns, damaged pages, cut at several points;
- output paths that cannot be written: dangling symlinks, a file where a folder goes (and the
  reverse) under --run-dir/--ckpt-dir, names over 255 bytes, /dev/full and FIFOs;
- run folders whose numbers are adversarial (all-zero seconds, 1e308, steps of 1e18);
- known_hosts files with marker lines or keys that do not parse; a --timeout-s below a second.
Rules as in testkit/fuzz.py: exit 2, a message naming the flag or file, no traceback, nothing
written.
"""

from __future__ import annotations

import functools
import io
import json

from testkit import fuzz_runs
from testkit.fuzz import (
    HOSTS,
    Case,
    Content,
    Fifo,
    Link,
    Raw,
    Scenario,
    cluster_dict,
    mutated,
    plan_dict,
    to_json,
    with_flag,
)
from testkit.fuzz_runs import (
    CORPUS,
    LOCK_LEFT,
    _jsonl_raw,
    _metrics_records,
    _rank_records,
    dist_runner_data_base,
    dist_runner_run_dir_base,
    explain_base,
    plot_run_base,
    prepare_data_base,
)

SPECIAL: list[tuple[str, Content]] = [("a FIFO", Fifo()), ("a symlink to /dev/zero",
                                                          Link("/dev/zero"))]
"""What replaces a file that is read."""
EXTREME = [1e308, 1.7976931348623157e308, 5e-324, 1e-300, Raw("1e300")]
"""Finite numbers no link or device can have."""
LONG_NAME = "n" * 300
"""A file name longer than the 255 bytes Linux takes (ENAMETOOLONG)."""


def special_file_cases() -> list[Case]:
    """A FIFO or a /dev/zero symlink as each file an entry point reads."""
    sim = Scenario("scheduler", ("simulate", "--cluster", "c.json", "--plan", "p.json"),
                   {"c.json": to_json(cluster_dict()), "p.json": to_json(plan_dict())})
    ex, pr, dr = explain_base(), plot_run_base(), dist_runner_data_base()
    ssh = Scenario("cluster_ssh", ("--hosts", "ip_list", "--known-hosts", "kh", "--timeout",
                                   "5", "run", "--", "true"), {"ip_list": HOSTS, "kh": b""})
    targets = [(sim, "c.json", ("c.json",)), (sim, "p.json", ("p.json",)),
               (dr, "p.json", ("p.json",)), (ex, "run/ranks/rank1.jsonl", ("rank1.jsonl",)),
               (Scenario(ex.entry, with_flag(ex.argv, "--cluster", None), ex.files),
                "run/cluster.json", ("cluster.json",)),
               (pr, "run/metrics.jsonl", ("metrics.jsonl",)),
               (ssh, "kh", ("--known-hosts",)), (ssh, "ip_list", ("ip_list",))]
    out = [s.file(name, content, names, label)
           for s, name, names in targets for label, content in SPECIAL]
    tok = with_flag(dr.argv, "--tokenizer", "tok.json")
    for label, content in SPECIAL:
        out.append(dr.argv_case(tok, ("--tokenizer",), f"--tokenizer {label}",
                                {"tok.json": content}))
        out.append(dr.argv_case(with_flag(dr.argv, "--data", "x.jsonl"), ("x.jsonl", "data"),
                                f"--data {label}", {"x.jsonl": content}))
    return out


@functools.cache
def compact_cluster() -> dict:
    """cluster_dict() in the compact form (cluster/2)."""
    from formats.cluster import cluster_from_dict

    return cluster_from_dict(cluster_dict()).to_compact().to_dict()


def extreme_cluster_cases() -> list[Case]:
    """Every link and device number of both cluster forms set to an extreme finite value,
    under `simulate` and `plan`."""
    full, compact = cluster_dict(), compact_cluster()
    paths = [(full, ("latency_ms", 0, 2), "latency_ms"), (full, ("bandwidth_gbps", 2, 1),
                                                          "bandwidth_gbps"),
             (full, ("devices", 1, "tflops"), "tflops"),
             (full, ("devices", 3, "memory_gb"), "memory_gb"),
             (compact, ("region_links", 1, "latency_ms"), "latency_ms"),
             (compact, ("region_links", 1, "bandwidth_gbps"), "bandwidth_gbps")]
    files = {"p.json": to_json(plan_dict())}
    sim = Scenario("scheduler", ("simulate", "--cluster", "c.json", "--plan", "p.json"), files)
    plan = Scenario("scheduler", ("plan", "--cluster", "c.json", "--model", "gpt-tiny",
                                  "--budget", "5", "--out", "o.json", "--quiet"), files)
    out = []
    for base, path, field in paths:
        form = "compact" if base is compact else "full"
        for value in EXTREME:
            if "memory" in field and value in (1e308, 1.7976931348623157e308):
                continue  # memory beyond need is no error the planner can see; 1e9 GB cap
            if "latency" in field and not isinstance(value, Raw) and value < 1:
                continue  # a tiny latency is a fast link, not an error
            content = to_json(_symmetric(mutated(base, path, value), path, value))
            shown = value.text if isinstance(value, Raw) else repr(value)
            for s in (sim, plan):
                out.append(s.file("c.json", content, (field,),
                                  f"{form} {field} = {shown}"))
    return out


def _symmetric(obj: dict, path: tuple, value: object) -> dict:
    """The full form's matrices keep i -> j and j -> i alike (what a measured file has)."""
    if len(path) == 3 and path[0] in ("latency_ms", "bandwidth_gbps"):
        obj[path[0]][path[2]][path[1]] = value
    return obj


@functools.cache
def tokenizer_without_unk() -> bytes:
    """A WordLevel tokenizers file without unk_token (any unknown word fails to encode)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"line": 0, "the": 1}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


@functools.cache
def parquet_variants() -> dict[str, bytes]:
    """Damaged parquet corpora: two `text` columns, cut at 1/3 and 2/3, bytes of the first
    data page flipped, the footer kept but the middle cut out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = CORPUS.decode().splitlines()
    buf = io.BytesIO()
    pq.write_table(pa.table([pa.array(texts), pa.array(texts)], names=["text", "text"]), buf)
    out = {"two text columns": buf.getvalue()}
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf, use_dictionary=False, compression="none")
    good = buf.getvalue()
    flipped = bytearray(good)
    flipped[20:60] = bytes(b ^ 0xFF for b in flipped[20:60])
    out["page bytes flipped"] = bytes(flipped)
    out["cut at 1/3"] = good[:len(good) // 3]
    out["cut at 2/3"] = good[:2 * len(good) // 3]
    out["middle cut out, footer kept"] = good[:200] + good[-len(good) // 3:]
    return out


def corpus_and_tokenizer_cases() -> list[Case]:
    """Damaged parquet corpora and a tokenizer that cannot encode, under prepare_data and
    dist_runner (found while tokenizing: the cache's lock file may stay, nothing else)."""
    out = []
    for s in (prepare_data_base(), dist_runner_data_base()):
        for label, content in parquet_variants().items():
            c = s.argv_case(with_flag(s.argv, "--data", "x.parquet"), ("x.parquet",),
                            f"--data parquet {label}", {"x.parquet": content})
            out.append(Case(c.entry, c.argv, c.files, c.names, c.label, LOCK_LEFT))
        c = s.argv_case(with_flag(s.argv, "--tokenizer", "tok.json"), ("--tokenizer",),
                        "--tokenizer WordLevel without unk_token",
                        {"tok.json": tokenizer_without_unk()})
        out.append(Case(c.entry, c.argv, c.files, c.names, c.label, LOCK_LEFT))
    return out


def output_path_cases() -> list[Case]:
    """Outputs that cannot be written, all found before the rendezvous (rank 1 of the plan
    is replica 0's last stage: it writes run/metrics.jsonl)."""
    s = dist_runner_run_dir_base()
    r1 = with_flag(s.argv, "--rank", "1")
    ck = (*r1, "--ckpt-dir", "ck", "--ckpt-every", "1")
    out = [
        s.argv_case(r1, ("--run-dir",), "--run-dir a dangling symlink", {"run": Link("no/x")}),
        s.argv_case(ck, ("--ckpt-dir",), "--ckpt-dir a dangling symlink", {"ck": Link("no/x")}),
        s.argv_case(r1, ("--run-dir",), "run/ranks a file", {"run/ranks": b"x"}),
        s.argv_case(r1, ("--run-dir",), "run/ranks/rank1.jsonl a folder",
                    {"run/ranks/rank1.jsonl/x": b""}),
        s.argv_case(r1, ("--run-dir",), "run/metrics.jsonl a folder",
                    {"run/metrics.jsonl/x": b""}),
        s.argv_case(ck, ("--ckpt-dir",), "ck/rank1 a file", {"ck/rank1": b"x"}),
        s.argv_case((*with_flag(r1, "--run-dir", None), "--metrics", "/dev/full"),
                    ("--metrics",), "--metrics /dev/full"),
        s.argv_case((*with_flag(r1, "--run-dir", None), "--metrics", "m.jsonl"),
                    ("--metrics",), "--metrics a FIFO", {"m.jsonl": Fifo()}),
        *[s.argv_case(with_flag(ck, flag, value), (flag,), f"{flag} a 300-byte name")
          for flag, value in (("--run-dir", LONG_NAME), ("--ckpt-dir", LONG_NAME),
                              ("--metrics", LONG_NAME + ".jsonl"),
                              ("--run-dir", f"a/{LONG_NAME}/b"))],
        *s.flag("--timeout-s", ["1e-300", "5e-324", "0.5"]),
    ]
    long_out = [("scheduler", ("scenario", "random", "--out", LONG_NAME + ".json"), "--out"),
                ("plot_run", ("run", "--out", LONG_NAME + ".png"), "--out"),
                ("train_tokenizer", ("--data", "corpus.txt", "--vocab-size", "300", "--out",
                                     LONG_NAME + ".json"), "--out")]
    files = {**plot_run_base().files, "corpus.txt": CORPUS}
    out += [Case(entry, argv, files, (flag,), f"{flag} a 300-byte name")
            for entry, argv, flag in long_out]
    return out


def _all_ranks(change: dict, steps: list[int] | None = None) -> dict[str, Content]:
    """Every rank's timing file of explain_base()'s run with `change` in every record."""
    out: dict[str, Content] = {}
    for r, pipe in enumerate(plan_dict()["pipelines"]):
        for s, d in enumerate(pipe):
            recs = _rank_records(d, r, s, change=change)
            for rec, step in zip(recs, steps or []):
                rec["step"] = step
            out[f"run/ranks/rank{d}.jsonl"] = _jsonl_raw(recs)
    return out


def adversarial_metrics_cases() -> list[Case]:
    """Run folders whose numbers are all zero, near the float limit or steps apart by 1e18."""
    ex, pr = explain_base(), plot_run_base()
    seconds = ("step_s", "compute_s", "comm_s", "pp_wait_s")
    out = []
    for label, value in (("0", 0.0), ("1e308", 1e308), ("1.7e308", 1.7976931348623157e308),
                         ("-1e308", -1e308), ("1e300", Raw("1e300"))):
        if label == "0":
            out.append(Case("scheduler", ex.argv, {**ex.files, **_all_ranks(
                dict.fromkeys(seconds, value))}, ("--metrics", "step_s"),
                f"every rank's seconds = {label}"))
            continue
        out.append(Case("scheduler", ex.argv, {**ex.files, **_all_ranks(
            dict.fromkeys(seconds, value))}, ("--metrics",), f"every rank's seconds = {label}"))
        bad = _jsonl_raw(_metrics_records(change=dict.fromkeys(
            ("loss", "tokens", "tokens_per_s", "bytes_sent", "step_s", "wall_time"), value)))
        out.append(Case("plot_run", pr.argv, {**pr.files, "run/metrics.jsonl": bad,
                                               "run/metrics.r1.jsonl": bad},
                        ("RUN_DIR",), f"every metrics number = {label}"))
    steps = [1, 10 ** 18, 2 * 10 ** 18]
    recs = _metrics_records(change={"loss": 1e308})
    for rec, step in zip(recs, steps):
        rec["step"] = step
    far = _jsonl_raw(recs)
    out.append(Case("plot_run", pr.argv, {**pr.files, "run/metrics.jsonl": far,
                                           "run/metrics.r1.jsonl": far}, ("RUN_DIR",),
                    "loss 1e308 at steps 1e18 apart"))
    return out


KNOWN_HOSTS_LINES = [
    "@revoked 10.0.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFakeFakeFakeFakeFakeFakeFake",
    "@cert-authority *.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake",
    "10.0.0.1 ssh-ed25519 AAAA!!!notbase64",
    "10.0.0.1 ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAINHlMuyfB7oHbdu7JaoZsLO0OZ87t7M1JWCPkFW4+Jef",
    "10.0.0.1 ssh-ed25519 eHh4eHh4eHh4eA==",
    "|1|notbase64|x ssh-ed25519 AAAA",
]
"""known_hosts lines paramiko refuses with a traceback (markers, keys that do not parse)."""


def known_hosts_cases() -> list[Case]:
    """Each bad known_hosts line under cluster_ssh, measure and tc (before any connection)."""
    files = {"ip_list": HOSTS, "c.json": to_json(cluster_dict())}
    bases = [Scenario("cluster_ssh", ("--hosts", "ip_list", "--known-hosts", "kh", "--timeout",
                                      "5", "run", "--", "true"), files),
             Scenario("measure", ("--hosts", "ip_list", "--known-hosts", "kh", "--model",
                                  "gpt-tiny", "--out", "m.json", "--timeout", "5"), files),
             Scenario("tc", ("show", "--cluster", "c.json", "--hosts", "ip_list",
                             "--known-hosts", "kh"), files)]
    return [s.file("kh", (line + "\n").encode(), ("--known-hosts",), f"line {line[:24]!r}")
            for s in bases for line in KNOWN_HOSTS_LINES]


GENERATORS = (special_file_cases, extreme_cluster_cases, corpus_and_tokenizer_cases,
              output_path_cases, adversarial_metrics_cases, known_hosts_cases)
"""Every generator of this module."""


@functools.cache
def dictionary_parquet() -> bytes:
    """A parquet corpus whose text column is dictionary-encoded (ordinary text: accepted)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    texts = pa.array(CORPUS.decode().splitlines()).dictionary_encode()
    pq.write_table(pa.table({"text": texts}), buf)
    return buf.getvalue()


def base_scenarios() -> list[Scenario]:
    """Valid inputs near this module's cases that must be accepted: a dictionary-encoded
    parquet corpus, a tokenizer file with padding and truncation set."""
    s = prepare_data_base()
    return [Scenario(s.entry, with_flag(s.argv, "--data", "d.parquet"),
                     {**s.files, "d.parquet": dictionary_parquet()}),
            Scenario(s.entry, with_flag(s.argv, "--tokenizer", "tok.json"),
                     {**s.files, "tok.json": padded_tokenizer()})]


@functools.cache
def padded_tokenizer() -> bytes:
    """A byte-level BPE tokenizers file with Fixed padding to 4M and truncation to 0 set (the
    runtime switches both off: whole documents are tokenized into one stream)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"line": 0, "the": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.enable_padding(length=4_000_000)
    data = json.loads(tok.to_str())
    data["truncation"] = {"direction": "Right", "max_length": 0, "strategy": "LongestFirst",
                          "stride": 0}
    return json.dumps(data).encode()


def cases() -> list[Case]:
    """All cases of this module."""
    return [c for gen in GENERATORS for c in gen()]


def all_cases(seed: int) -> list[Case]:
    """Every fuzz case: fuzz_entry_points.py's, fuzz_random.py's, fuzz_runs.py's and this
    module's."""
    return [*fuzz_runs.all_cases(seed), *cases()]


def all_base_scenarios() -> list[Scenario]:
    """Every valid command line the cases break (testkit/fuzz_runs.py's and this module's)."""
    return [*fuzz_runs.base_scenarios(), *base_scenarios()]
