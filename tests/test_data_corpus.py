"""Corpus reading, byte tokens, the train/validation split and per-replica sharding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from formats.errors import UserError
from modules.config import DataConfig
from modules.data.dataset import (
    DEFAULT_CORPUS,
    FakeData,
    Sharder,
    TextData,
    corpus_files,
    load_tokens,
)


def _corpus(tmp_path):
    (tmp_path / "a").write_text("hello world\n%\nsecond fortune\n" * 200)
    (tmp_path / "a.dat").write_bytes(b"\x00\x01index")
    (tmp_path / "a.u8").symlink_to(tmp_path / "a")
    (tmp_path / "b").write_text("another file " * 300)
    return tmp_path


def test_folder_skips_indexes_and_duplicates(tmp_path):
    files = corpus_files(_corpus(tmp_path))
    assert [f.name for f in files] == ["a", "b"]
    tokens = load_tokens(tmp_path)
    assert tokens.dtype == np.uint8
    assert bytes(tokens[:11]) == b"hello world"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist.*--data FILE"):
        load_tokens(tmp_path / "nope")


@pytest.mark.parametrize("value", ["", ",", " , ,"])
def test_data_naming_nothing_is_an_error_not_the_current_folder(value, tmp_path, monkeypatch):
    monkeypatch.chdir(_corpus(tmp_path))  # a readable folder: "" must not read it
    with pytest.raises(UserError, match="--data .* names no file"):
        corpus_files(value)
    with pytest.raises(UserError, match="--data: names no file"):
        DataConfig(data=value)


def test_split_is_disjoint_and_deterministic(tmp_path):
    tokens = load_tokens(_corpus(tmp_path))
    d1, d2 = TextData(tokens, 16, 256), TextData(tokens, 16, 256)
    assert not set(d1.train_starts) & set(d1.val_starts)
    assert len(d1.val_starts) == (len(tokens) - 1) // 16 // 20
    assert torch.equal(d1.samples(5, 7)[0], d2.samples(5, 7)[0])
    assert not torch.equal(d1.samples(0, 8)[0], TextData(tokens, 16, 256, seed=1).samples(0, 8)[0])
    x, y = d1.samples(0, 4)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_epochs_cover_every_window_once(tmp_path):
    d = TextData(load_tokens(_corpus(tmp_path)), 16, 256)
    n = len(d.train_starts)
    firsts = {int(d._train_start(g)) for g in range(n)}
    assert firsts == set(map(int, d.train_starts))


@pytest.mark.parametrize("data_kind", ["text", "fake"])
def test_replica_shards_concatenate_to_the_global_batch(tmp_path, data_kind):
    data = (TextData(load_tokens(_corpus(tmp_path)), 16, 256) if data_kind == "text"
            else FakeData(16, 256, seed=3))
    sh = Sharder(data, num_replicas=3, num_micro_batches=2, micro_batch_size=2)
    for step in (0, 4):
        parts = [torch.cat(sh.micro_batches(step, r)[0]) for r in range(3)]
        want = data.samples(step * sh.global_batch, sh.global_batch)[0]
        assert torch.equal(torch.cat(parts), want)
        assert not torch.equal(parts[0], parts[1])


def test_small_vocab_is_refused(tmp_path):
    with pytest.raises(UserError, match="vocab_size >= 256"):
        TextData(load_tokens(_corpus(tmp_path)), 16, 100)


def test_fortunes_corpus_when_installed():
    if not DEFAULT_CORPUS.exists():
        pytest.skip("Debian fortunes not installed (apt-get install fortunes fortunes-min)")
    tokens = load_tokens(DEFAULT_CORPUS)
    assert len(tokens) > 1_000_000
    assert not any(f.suffix in (".dat", ".u8") for f in corpus_files(DEFAULT_CORPUS))
