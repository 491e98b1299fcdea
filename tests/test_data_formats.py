"""Corpus formats (.txt/.jsonl/.parquet, folders, globs), the token cache, tokenizer files, the
model's vocabulary following the tokenizer, and bad data input as exit-2 errors."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from formats.errors import UserError
from formats.models import get_model
from formats.plan import Plan, save_plan
from modules.config import DataConfig
from modules.data.corpus import PIECE_BYTES, ReadStats, corpus_files
from modules.data.dataset import Sharder, TextData, load_data
from modules.data.token_cache import open_tokens, token_stream
from modules.data.tokenizer import BYTES_ID, ByteTokenizer, HFTokenizer, load_tokenizer
from modules.train.checkpoint import complete_steps, load_checkpoint, step_path
from scripts import prepare_data, train_tokenizer
from tests.conftest import run_entry

TINY = get_model("gpt-tiny")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hex", "jolly", "zebras,", "naïve", "café", "crème"]
LONG = "é" * (PIECE_BYTES // 2 + 3)  # one line longer than a piece, cut inside a character


def _docs(n: int, seed: int = 0) -> list[str]:
    """`n` documents of seeded pseudo-text (non-ASCII included), each a few lines."""
    rng = np.random.default_rng(seed)
    return ["\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(4)) for _ in range(n)]


def _write(folder, docs: list[str]) -> dict[str, object]:
    """The same documents as .txt files (one each), one .jsonl and one .parquet."""
    txt = folder / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    lines.insert(1, json.dumps({"title": "no text here"}))  # skipped, counted
    lines.insert(2, "")  # blank: skipped
    (folder / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(len(docs) + 1)),
                             "text": [*docs[:1], None, *docs[1:]]}), folder / "c.parquet")
    return {"txt": txt, "jsonl": folder / "c.jsonl", "parquet": folder / "c.parquet"}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A byte-level BPE trained by scripts/train_tokenizer.py on seeded pseudo-text."""
    d = tmp_path_factory.mktemp("tok")
    (d / "corpus.txt").write_text("\n\n".join(_docs(300, seed=1)), encoding="utf-8")
    out = d / "tok.json"
    assert train_tokenizer.main(["--data", str(d / "corpus.txt"), "--vocab-size", "400",
                                 "--out", str(out)]) == 0
    return out


def _stream(files, tok, field="text") -> tuple[np.ndarray, ReadStats]:
    stats = ReadStats()
    ids = np.concatenate(list(token_stream(corpus_files(files), tok, field, stats)))
    return ids, stats


@pytest.mark.parametrize("tokenizer", ["bytes", "file"])
def test_txt_jsonl_and_parquet_give_the_same_tokens(tmp_path, tok_path, tokenizer):
    tok = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(tok_path)
    docs = [*_docs(5), LONG + "\nend", ""]  # a long line and an empty document too
    paths = _write(tmp_path, docs)
    want, stats = _stream(paths["txt"], tok)
    assert stats.documents == len(docs)
    for kind in ("jsonl", "parquet"):
        got, stats = _stream(paths[kind], tok)
        assert np.array_equal(got, want), kind
        assert (stats.documents, stats.skipped) == (len(docs), 1)
    if tokenizer == "bytes":  # documents joined by a newline: today's byte stream
        assert bytes(want.astype(np.uint8)) == "\n".join(docs).encode()
    else:
        eot = tok.tok.token_to_id("<|endoftext|>")
        assert int((want == eot).sum()) == len(docs) - 1
        assert tok.tok.decode(want[want != eot].tolist()) == "".join(docs)


def test_folders_globs_and_lists(tmp_path):
    paths = _write(tmp_path, _docs(3))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("x")
    (tmp_path / "sub" / ".hidden").write_text("skipped")
    txt_files = sorted(paths["txt"].iterdir())
    assert corpus_files(paths["txt"]) == txt_files
    assert corpus_files(f"{paths['txt']}/*.txt") == txt_files
    both = corpus_files(f"{paths['jsonl']},{tmp_path}/**/*.txt,{txt_files[0]}")
    assert both == [paths["jsonl"], tmp_path / "sub" / "x.txt", *txt_files]  # each file once
    with pytest.raises(UserError, match="unsupported suffix '.csv'"):
        (tmp_path / "sub" / "y.csv").write_text("a,b")
        corpus_files(tmp_path / "sub")


def test_cache_is_a_memmap_reused_and_keyed_by_the_files(tmp_path, tok_path):
    paths = _write(tmp_path, _docs(60))
    cache = tmp_path / "cache"
    tok = HFTokenizer(tok_path)
    first = open_tokens(corpus_files(paths["jsonl"]), tok, "text", cache)
    assert isinstance(first.tokens, np.memmap) and first.tokens.dtype == np.uint16
    assert first.built_s is not None and first.info["skipped"] == 1
    again = open_tokens(corpus_files(paths["jsonl"]), tok, "text", cache)
    assert again.built_s is None and again.path == first.path  # reused
    assert np.array_equal(again.tokens, _stream(paths["jsonl"], tok)[0])
    by_bytes = open_tokens(corpus_files(paths["jsonl"]), ByteTokenizer(), "text", cache)
    assert by_bytes.path != first.path and by_bytes.tokens.dtype == np.uint8
    with open(paths["jsonl"], "a") as f:  # the corpus changed: tokenized again
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = open_tokens(corpus_files(paths["jsonl"]), tok, "text", cache)
    assert changed.built_s is not None and len(changed.tokens) > len(first.tokens)
    assert not list(cache.glob(".*.tmp"))  # temp files renamed or removed


@pytest.mark.parametrize("name, content", [("e.txt", ""), ("e.jsonl", '{"body": "x"}\n\n')])
def test_a_corpus_without_text_leaves_no_cache_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="holds no text"):
        open_tokens(corpus_files(tmp_path / name), ByteTokenizer(), "text", cache)
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # no ids, no sidecar, no temp


def test_windows_read_slices_of_the_memmap_not_the_whole_corpus(tmp_path):
    n = 40_000_000  # 80 MB of uint16 ids in a sparse file, never read whole
    tokens = np.memmap(tmp_path / "big.uint16", dtype=np.uint16, mode="w+", shape=(n,))
    tokens[-1000:] = np.arange(1000)
    tokens.flush()
    tokens = np.memmap(tmp_path / "big.uint16", dtype=np.uint16, mode="r", shape=(n,))
    tracemalloc.start()
    data = TextData(tokens, 64, 1024, tokenizer=BYTES_ID)
    x, _ = data.samples(123, 8)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert data.tokens is tokens and x.shape == (8, 64)
    assert peak < tokens.nbytes / 4, peak  # the split's index arrays, not the ids


def test_shards_concatenate_and_validation_never_trains(tmp_path, tok_path):
    paths = _write(tmp_path, _docs(200))
    tok = HFTokenizer(tok_path)
    corpus = open_tokens(corpus_files(paths["parquet"]), tok, "text", tmp_path / "cache")
    data = TextData(corpus.tokens, 16, tok.ident.vocab_size, seed=3, tokenizer=tok.ident)
    sh = Sharder(data, num_replicas=2, num_micro_batches=2, micro_batch_size=3)
    for step in (0, 7):
        parts = [torch.cat(sh.micro_batches(step, r)[0]) for r in range(2)]
        assert torch.equal(torch.cat(parts), data.samples(step * 12, 12)[0])
    n_train = len(data.train_starts)
    seen = {tuple(row) for row in data.samples(0, n_train)[0].tolist()}
    val = {tuple(row) for b in data.val_batches(len(data.val_starts), 1) for row in
           b[0].tolist()}
    train = {tuple(corpus.tokens[s:s + 16].tolist()) for s in data.train_starts}
    assert seen == train  # one epoch covers every training window once
    assert val and not val & seen  # no validation window is trained on
    assert max(max(r) for r in seen) < tok.ident.vocab_size


def test_trained_tokenizer_round_trips_and_names_its_vocab(tok_path):
    tok = load_tokenizer(str(tok_path))
    assert tok.ident.vocab_size <= 400 and tok.ident.vocab_size > 256
    text = "The naïve fox — 漢字 🦊\n\tjumps!"
    ids = tok.tok.encode(text, add_special_tokens=False).ids
    assert tok.tok.decode(ids) == text
    assert len(tok.tok.encode("the quick brown fox").ids) < len("the quick brown fox")
    assert load_tokenizer("bytes").ident == BYTES_ID


def test_model_vocab_follows_the_tokenizer(tmp_path, tok_path):
    paths = _write(tmp_path, _docs(200))
    cfg = DataConfig(data=str(paths["jsonl"]), tokenizer=str(tok_path),
                     token_cache=str(tmp_path / "c"))
    lines: list[str] = []
    data = load_data(cfg, TINY, seed=0, log=lines.append)
    assert data.vocab_size == data.tokenizer.vocab_size == HFTokenizer(tok_path).ident.vocab_size
    assert "model vocab" in lines[0] and "1 record(s) without 'text' skipped" in lines[1]
    fake = load_data(DataConfig(fake_data=True, tokenizer=str(tok_path)), TINY, seed=0)
    assert fake.vocab_size == data.vocab_size
    byte_data = load_data(DataConfig(data=str(paths["txt"]), token_cache=str(tmp_path / "c")),
                          get_model("llama-150m"), seed=0, log=lines.append)
    assert byte_data.vocab_size == 32000  # bytes keep the preset's vocabulary


def test_prepare_data_fills_the_cache_a_run_reuses(tmp_path, tok_path, capsys):
    paths = _write(tmp_path, _docs(100))
    cache = str(tmp_path / "cache")
    assert prepare_data.main(["--data", str(paths["parquet"]), "--tokenizer", str(tok_path),
                              "--token-cache", cache]) == 0
    assert "tokenized in" in capsys.readouterr().out
    lines: list[str] = []
    load_data(DataConfig(data=str(paths["parquet"]), tokenizer=str(tok_path), token_cache=cache),
              TINY, seed=0, log=lines.append)
    assert lines[-1].endswith("(reused)"), lines


# -- bad input -----------------------------------------------------------------------------
def _bad_inputs(tmp_path, tok_path) -> dict[str, tuple[dict, str]]:
    """label -> (DataConfig fields, the error's text)."""
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1") * 2000)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "a.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "tok.json").write_text('{"model": "nope"}')
    (tmp_path / "tok.txt").write_text("not json")
    ok = str(tmp_path / "short.txt")
    return {
        "missing": ({"data": str(tmp_path / "nope.txt")}, "does not exist"),
        "glob": ({"data": str(tmp_path / "*.nothing")}, "matches no file"),
        "suffix": ({"data": str(tmp_path / "a.csv")}, "unsupported suffix '.csv'"),
        "empty": ({"data": str(tmp_path / "empty.txt")}, "holds no text"),
        "short": ({"data": ok}, "corpus too small"),
        "json": ({"data": str(tmp_path / "bad.jsonl")}, f"{tmp_path / 'bad.jsonl'}:2: not JSON"),
        "field": ({"data": str(tmp_path / "notext.jsonl")}, "1 record(s) had no 'text' field"),
        "type": ({"data": str(tmp_path / "num.jsonl")}, "field 'text' is int, not a string"),
        "deep": ({"data": str(tmp_path / "deep.jsonl")},
                 f"{tmp_path / 'deep.jsonl'}:2: JSON nested too deep"),
        "column": ({"data": str(tmp_path / "nocol.parquet")}, "no column 'text' (columns: body)"),
        "parquet": ({"data": str(tmp_path / "junk.parquet")}, "not a readable parquet file"),
        "tokenizer": ({"data": ok, "tokenizer": str(tmp_path / "tok.json")},
                      "not a Hugging Face tokenizers JSON file"),
        "tok_json": ({"data": ok, "tokenizer": str(tmp_path / "tok.txt")},
                     "not a Hugging Face tokenizers JSON file"),
        "tok_missing": ({"data": ok, "tokenizer": str(tmp_path / "no.json")}, "no such file"),
        "utf8": ({"data": str(tmp_path / "latin1.txt"), "tokenizer": str(tok_path)},
                 f"{tmp_path / 'latin1.txt'}: not UTF-8 text (byte 0xe9)"),
    }


def test_bad_input_is_a_named_error(tmp_path, tok_path):
    for label, (fields, text) in _bad_inputs(tmp_path, tok_path).items():
        cfg = DataConfig(token_cache=str(tmp_path / "cache"), **fields)
        with pytest.raises(UserError, match=None) as e:
            load_data(cfg, TINY, seed=0, log=lambda _: None)
        assert text in str(e.value), (label, str(e.value))


PLAN1 = Plan("local", "", "gpt-tiny", [(0, 4)], [[0]], micro_batch_size=1)


@pytest.mark.parametrize("label", ["glob", "suffix", "empty", "json", "column", "tokenizer"])
def test_bad_input_exits_2_through_dist_runner(tmp_path, tok_path, label):
    fields, text = _bad_inputs(tmp_path, tok_path)[label]
    save_plan(PLAN1, tmp_path / "plan.json")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in fields.items()]
    proc = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--rank", "0",
                     "--dist-url", "tcp://127.0.0.1:1", "--steps", "1", "--token-cache",
                     str(tmp_path / "cache"), *args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: " in proc.stderr and text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _launch(plan_path, *extra):
    return run_entry("scripts/launch_local.py", "--plan", str(plan_path), "--threads-per-rank",
                     "1", "--grace-s", "2", "--", "--timeout-s", "60", *extra, timeout=150)


@pytest.mark.timeout(200)
def test_two_ranks_train_with_a_tokenizer_and_refuse_another_on_resume(tmp_path, tok_path):
    paths = _write(tmp_path, _docs(300))
    plan_path = tmp_path / "plan.json"
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=2),
              plan_path)
    ck, cache = tmp_path / "ck", tmp_path / "cache"
    common = ["--data", str(paths["jsonl"]), "--token-cache", str(cache), "--ckpt-dir", str(ck)]
    run = _launch(plan_path, *common, "--tokenizer", str(tok_path), "--steps", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    vocab = HFTokenizer(tok_path).ident.vocab_size
    assert f"model vocab {vocab} from --tokenizer" in run.stdout
    assert len(list(cache.glob("*.uint16"))) == 1  # both ranks share one cache file,
    assert run.stdout.count("tokenized in") == 1 and run.stdout.count("(reused)") == 1  # built once
    for rank in (0, 1):
        assert complete_steps(ck, rank) == [2]
        state = load_checkpoint(step_path(ck, rank, 2), {})
        assert state["model"]["embed.weight"].shape == (vocab, TINY.d_model)
        assert state["model"]["head.weight"].shape == (vocab, TINY.d_model)
    other = tmp_path / "other.json"
    assert train_tokenizer.main(["--data", str(paths["txt"]), "--vocab-size", "300",
                                 "--out", str(other)]) == 0
    for tok in (str(other),):
        again = _launch(plan_path, *common, "--tokenizer", tok, "--steps", "3", "--resume")
        assert again.returncode == 2, again.stdout[-3000:]
        assert "tokenizer is {'vocab_size'" in again.stdout
        assert "resume with the --tokenizer it was written with" in again.stdout


@pytest.mark.parametrize("files, flags, text", [
    ({"e.txt": ""}, [], "holds no text (1 document(s))"),
    ({"b.jsonl": '{"body": "x"}\n'}, [], "1 record(s) had no 'text' field (pick the field with "
                                         "--text-field)"),
    ({"a.txt": "some text\n"}, ["--text-field", ""], "--text-field: must name a field"),
])
def test_train_tokenizer_refuses_a_corpus_without_text(tmp_path, files, flags, text):
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    out = tmp_path / "tok.json"
    with pytest.raises(UserError) as e:
        train_tokenizer.main(["--data", str(tmp_path / next(iter(files))), "--out", str(out),
                              *flags])
    assert text in str(e.value) and not out.exists()


@pytest.mark.parametrize("flags, text", [(["--text-field", ""], "--text-field: must name"),
                                         (["--tokenizer", ""], "--tokenizer: must be")])
def test_prepare_data_checks_its_flags_as_the_runner_does(tmp_path, flags, text):
    (tmp_path / "a.txt").write_text("some text\n" * 100)
    with pytest.raises(UserError, match=text):
        prepare_data.main(["--data", str(tmp_path / "a.txt"), "--token-cache",
                           str(tmp_path / "cache"), *flags])
    assert not (tmp_path / "cache").exists()


@pytest.mark.timeout(120)
def test_ranks_with_different_tokenizers_are_refused_at_the_rendezvous(tmp_path, tok_path):
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.test_ssh_helpers import free_port

    paths = _write(tmp_path, _docs(200))
    plan_path = tmp_path / "plan.json"
    save_plan(Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=2),
              plan_path)
    url = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "dist_runner.py"), "--plan", str(plan_path), "--rank",
         str(r), "--world-size", "2", "--dist-url", url, "--data", str(paths["jsonl"]),
         "--token-cache", str(tmp_path / "cache"), "--tokenizer", tok, "--steps", "2",
         "--threads", "1", "--timeout-s", "20"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r, tok in ((0, "bytes"), (1, str(tok_path)))]
    outs = [p.communicate(timeout=100) for p in procs]
    codes = [p.returncode for p in procs]
    refused = [err for code, (_, err) in zip(codes, outs) if code == 2]
    assert refused and "--tokenizer: rank" in refused[0], (codes, outs)
    assert "give every rank the same --tokenizer" in refused[0]
    assert "Traceback" not in "".join(err for _, err in outs)
    assert all(code != 0 for code in codes)  # nobody trains on half a run
