"""Bad files of the third reliability pass, unit by unit: special files where a file is read,
a tampered token cache, tokenizers and parquet corpora that fail while read, extreme cluster
values, output paths checked before the rendezvous, adversarial run folders, known_hosts
lines paramiko refuses. (tests/test_fuzz_cli.py runs the same classes end to end.)"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from formats.atomic_io import check_output_dir, check_output_path
from formats.cluster import cluster_from_dict
from formats.errors import UserError
from formats.safe_open import check_regular, open_regular, read_bytes
from testkit.fuzz import cluster_dict, plan_dict
from testkit.fuzz_files import compact_cluster, parquet_variants, tokenizer_without_unk


@pytest.fixture
def specials(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a symlink to /dev/zero, a folder and a 10-byte file."""
    fifo, zero, folder, small = (tmp_path / n for n in ("fifo", "zero", "dir", "small"))
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    folder.mkdir()
    small.write_bytes(b"0123456789")
    return {"fifo": fifo, "zero": zero, "dir": folder, "small": small}


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_safe_open_refuses_what_would_block_or_never_end(specials: dict, kind: str) -> None:
    for read in (lambda p: read_bytes(p, "thing", 100), lambda p: open_regular(p, "thing"),
                 lambda p: check_regular(p, "thing")):
        with pytest.raises(UserError, match=f"thing {specials[kind]}: (not a regular|is a dir)"):
            read(specials[kind])


def test_safe_open_limits_the_size(specials: dict) -> None:
    assert read_bytes(specials["small"], "thing", 10) == b"0123456789"
    with pytest.raises(UserError, match="10 bytes, larger than the 9"):
        read_bytes(specials["small"], "thing", 9)
    with pytest.raises(UserError, match="cannot read thing .*No such file"):
        read_bytes(specials["small"].with_name("missing"), "thing", 9)


def test_resume_skips_a_fifo_checkpoint_and_refuses_to_load_it(tmp_path: Path) -> None:
    from modules.train.checkpoint import complete_steps, load_checkpoint, step_path

    path = step_path(tmp_path, 0, 2)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    said: list[str] = []
    assert complete_steps(tmp_path, 0, said.append) == []  # returns: no blocking open
    assert "not a regular file" in said[0] and "skips step 2" in said[0]
    with pytest.raises(UserError, match="corrupt or unreadable .*not a regular file"):
        load_checkpoint(path, {"rank": 0})


# ---- token cache --------------------------------------------------------------------------

def _cache(tmp_path: Path, vocab_tokenizer: bool = True) -> tuple:
    """A built token cache of a small corpus (uint16 ids of a WordLevel tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from modules.data.corpus import corpus_files
    from modules.data.token_cache import open_tokens
    from modules.data.tokenizer import load_tokenizer

    words = [f"w{i}" for i in range(300)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "[UNK]"])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok.json").write_text(tok.to_str())
    rng = random.Random(0)
    (tmp_path / "c.txt").write_text(" ".join(rng.choice(words) for _ in range(2000)))
    files, t = corpus_files(tmp_path / "c.txt"), load_tokenizer(str(tmp_path / "tok.json"))
    first = open_tokens(files, t, "text", tmp_path / "tc")
    return first, lambda: open_tokens(files, t, "text", tmp_path / "tc")


def _tamper_ids(data: Path, rng: random.Random, vocab: int) -> None:
    """Change ids in place, keeping the size and the modification time."""
    st = data.stat()
    ids = np.fromfile(data, dtype=np.uint16)
    for _ in range(rng.randint(1, 4)):
        ids[rng.randrange(len(ids))] = rng.choice([vocab, 65535, rng.randrange(vocab)])
    ids.tofile(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))


SIDECAR_JUNK = [("tokens", 4000.0), ("tokens", -1), ("tokens", "4000"), ("tokens", True),
                ("max_id", 70000), ("max_id", None), ("sha256", 5), ("format", "tokens/0"),
                ("documents", 1.5), ("skipped", [])]


def test_a_tampered_token_cache_is_refused_before_training(tmp_path: Path) -> None:
    first, again = _cache(tmp_path)
    data, meta = first.path, first.path.with_suffix(".json")
    assert first.tokens.dtype == np.uint16 and again().built_s is None  # reused when intact
    ids, info = data.read_bytes(), meta.read_text()
    rng = random.Random(1)
    for _trial in range(20):  # seeded: ids changed, same size and mtime
        _tamper_ids(data, rng, 301)
        if data.read_bytes() != ids:
            with pytest.raises(UserError, match="does not match its sidecar .*sha256"):
                again()
        data.write_bytes(ids)
    for key, value in SIDECAR_JUNK:
        meta.write_text(json.dumps({**json.loads(info), key: value}))
        with pytest.raises(UserError, match="--token-cache: .*does not match its sidecar"):
            again()
    meta.write_text(info)
    data.unlink()
    data.mkdir()
    with pytest.raises(UserError, match="ids file .*is a directory"):
        again()
    shutil.rmtree(data)
    assert again().built_s is not None  # the ids file gone: tokenized again


def test_a_cache_without_a_checksum_is_built_again(tmp_path: Path) -> None:
    first, again = _cache(tmp_path)
    meta = first.path.with_suffix(".json")
    info = json.loads(meta.read_text())
    del info["sha256"], info["max_id"]  # what caches written before the check hold
    meta.write_text(json.dumps(info))
    rebuilt = again()
    assert rebuilt.built_s is not None
    assert rebuilt.info["sha256"] == hashlib.sha256(first.path.read_bytes()).hexdigest()


# ---- tokenizers ---------------------------------------------------------------------------

def test_tokenizer_encode_errors_and_panics_name_the_file(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from modules.data.tokenizer import load_tokenizer

    (tmp_path / "wl.json").write_bytes(tokenizer_without_unk())
    tok = load_tokenizer(str(tmp_path / "wl.json"))
    with pytest.raises(UserError, match="--tokenizer .*wl.json: cannot encode c.txt .*Missing"):
        tok.encode([b"unknown words"], "c.txt")

    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panic(*args: object, **kwargs: object) -> None:
        raise PanicException("regex backtrack limit")
    monkeypatch.setattr(tok, "tok", type("T", (), {"encode_batch": staticmethod(panic)})())
    with pytest.raises(UserError, match="cannot encode c.txt \\(regex backtrack limit\\)"):
        tok.encode([b"line"], "c.txt")


def test_tokenizer_vocabulary_cap_and_inference_settings(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from modules.data import tokenizer as tk
    from testkit.fuzz_files import padded_tokenizer

    (tmp_path / "pad.json").write_bytes(padded_tokenizer())
    tok = tk.load_tokenizer(str(tmp_path / "pad.json"))
    ids = tok.encode([b"line the line x"], "c.txt")[0]
    assert ids.tolist() == [0, 1, 0, 2]  # no 4M padding, not truncated to nothing
    monkeypatch.setattr(tk, "MAX_VOCAB", 2)
    with pytest.raises(UserError, match="3 tokens, more than the 2 .*GB of training memory"):
        tk.load_tokenizer(str(tmp_path / "pad.json"))


# ---- parquet ------------------------------------------------------------------------------

@pytest.mark.parametrize("label", ["two text columns", "page bytes flipped", "cut at 1/3",
                                   "cut at 2/3", "middle cut out, footer kept"])
def test_damaged_parquet_is_named_not_blamed_on_the_cache(tmp_path: Path, label: str) -> None:
    from modules.data.corpus import ReadStats, documents

    path = tmp_path / "x.parquet"
    path.write_bytes(parquet_variants()[label])
    with pytest.raises(UserError, match=f"data: {path}: ") as e:
        for doc in documents(path, "text", ReadStats()):
            list(doc)
    assert "\n" not in str(e.value) and "token cache" not in str(e.value)


def test_a_dictionary_encoded_text_column_reads_as_plain_text(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from modules.data.corpus import ReadStats, documents

    texts = ["a b", None, "c", "a b"]
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "p.parquet")
    read = [[b"".join(d) for d in documents(tmp_path / n, "text", ReadStats())]
            for n in ("d.parquet", "p.parquet")]
    assert read[0] == read[1] == [b"a b", b"c", b"a b"]


# ---- clusters -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e308, 5e-324, 1e-300, 2e9])
@pytest.mark.parametrize("form", ["full", "compact"])
@pytest.mark.parametrize("field", ["latency_ms", "bandwidth_gbps"])
def test_extreme_link_values_are_refused_naming_the_field(form: str, field: str,
                                                          value: float) -> None:
    obj = cluster_dict() if form == "full" else copy.deepcopy(compact_cluster())
    if form == "full":
        obj[field][0][2] = obj[field][2][0] = value
    else:
        obj["region_links"][1][field] = value
    if field == "latency_ms" and value < 1e7:
        cluster_from_dict(obj)  # a short latency is a fast link
        return
    with pytest.raises(UserError, match=f"{field}.*must be in \\["):
        cluster_from_dict(obj)


@pytest.mark.parametrize("field", ["tflops", "memory_gb"])
def test_extreme_device_values_are_refused(field: str) -> None:
    for value in (1e308, 5e-324):
        obj = cluster_dict()
        obj["devices"][1][field] = value
        with pytest.raises(UserError, match=f"devices\\[1\\].{field}: must be in"):
            cluster_from_dict(obj)


# ---- outputs ------------------------------------------------------------------------------

def test_output_checks_name_each_unwritable_path(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to("no/such")
    os.mkfifo(tmp_path / "fifo")
    cases = [(check_output_dir, tmp_path / "dangling", "is a symlink to no/such"),
             (check_output_path, tmp_path / "dangling", "is a symlink to no/such"),
             (check_output_dir, tmp_path / ("x" * 300), "300 bytes, more than the 255"),
             (check_output_path, tmp_path / "a" / ("x" * 256) / "m.jsonl", "256 bytes"),
             (check_output_path, "/dev/full", "not a regular file"),
             (check_output_path, tmp_path / "fifo", "not a regular file")]
    for check, path, why in cases:
        with pytest.raises(UserError, match=f"--flag {path}: .*{why}"):
            check(path, "--flag")


def test_every_rank_path_is_checked_before_the_rendezvous(tmp_path: Path) -> None:
    from formats.plan import plan_from_dict
    from modules.config import CheckpointConfig, MetricsConfig, RunConfig
    from modules.control.dist import topology
    from modules.train.outputs import check_outputs

    plan = plan_from_dict(plan_dict())
    run, ck = tmp_path / "run", tmp_path / "ck"
    cfg = RunConfig(steps=1, metrics=MetricsConfig(run_dir=str(run)),
                    ckpt=CheckpointConfig(dir=str(ck)))
    last, first = topology(plan, 1, 4), topology(plan, 0, 4)
    check_outputs(cfg, last)  # nothing there yet: fine, and nothing made
    assert not run.exists() and not ck.exists()
    for path, is_dir, rank in ((run / "ranks", False, first), (ck / "rank0", False, first),
                               (run / "metrics.jsonl", True, last),
                               (run / "ranks" / "rank1.jsonl", True, last)):
        path.parent.mkdir(parents=True, exist_ok=True)
        if is_dir:
            path.mkdir()
        else:
            path.write_bytes(b"x")
        with pytest.raises(UserError, match=f"(--run-dir|--ckpt-dir) {path}: "):
            check_outputs(cfg, rank)
        if path.name != "ranks":  # shared by every rank; the others are this rank's own
            check_outputs(cfg, first if rank is last else last)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(ck, ignore_errors=True)


# ---- run folders and known_hosts -----------------------------------------------------------

def test_record_numbers_beyond_1e15_and_steps_beyond_1e12_are_damage() -> None:
    from formats.run_metrics import has_step, number

    assert number({"x": 1e15}, "x") == 1e15
    assert [number({"x": v}, "x") for v in (1e308, -1e16, 10 ** 400)] == [None] * 3
    assert has_step({"step": 10 ** 12}) and not has_step({"step": 10 ** 18})
    assert not has_step({"step": True}) and not has_step({"step": -1})


@pytest.mark.parametrize("line", ["@revoked 10.0.0.1 ssh-ed25519 AAAA",
                                  "@cert-authority * ssh-ed25519 AAAA",
                                  "10.0.0.1 ssh-ed25519 AAAA!!!x", "10.0.0.1 ssh-rsa eHh4"])
def test_known_hosts_lines_paramiko_refuses_are_one_line_errors(tmp_path: Path,
                                                                line: str) -> None:
    from scripts.netemu.sshctl import check_known_hosts

    kh = tmp_path / "kh"
    kh.write_text(f"# comment\n\n{line}\n")
    with pytest.raises(UserError, match=f"--known-hosts {kh}:3: ") as e:
        check_known_hosts(kh)
    assert "\n" not in str(e.value)
