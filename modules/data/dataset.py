"""Training text: corpus files, a tokenizer, a token cache, a train/validation split, sharding.

The default corpus is Debian's `fortunes` (+ `fortunes-min`), installed by the project's setup
from the Debian archive: ~2.7 MB of English text under /usr/share/games/fortunes, read with the
byte tokenizer (vocab 256), so nothing has to be trained or downloaded. --data takes files,
folders and globs of .txt, .jsonl and .parquet (modules.data.corpus); --tokenizer a local
tokenizer.json (modules.data.tokenizer). The corpus is tokenized once into a memory-mapped token
cache (modules.data.token_cache) shared by the runs and ranks of a host; windows are slices of it,
so no rank holds the corpus in memory.

The model's vocabulary follows the tokenizer: with a tokenizer file its embedding and head have
the tokenizer's vocab_size rows (whatever the plan's preset says; the plan's memory and FLOPs
figures assumed the preset's); with bytes they keep the preset's (>= 256; ids >= 256 unused).

Windows of seq_len + 1 tokens (inputs and shifted targets) start every seq_len tokens; every
`val_every`-th window is held out for validation. Step `k` of a run with R replicas, M
micro-batches and micro-batch size b uses global samples [k*R*M*b, (k+1)*R*M*b) of a seeded
permutation of the training windows (a new permutation each epoch); replica r takes the r-th
contiguous slice, so the concatenation over replicas is the global batch a single process would
see, and the position in the data is a pure function of the step (checkpoints store the step).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from formats.errors import UserError
from formats.models import ModelSpec
from modules.config import DataConfig
from modules.data.corpus import DEFAULT_CORPUS, ReadStats, corpus_files
from modules.data.token_cache import open_tokens, token_stream
from modules.data.tokenizer import (
    BYTES_ID,
    ByteTokenizer,
    TokenizerId,
    load_tokenizer,
    vocab_memory,
)

__all__ = ["DEFAULT_CORPUS", "FakeData", "Sharder", "TextData", "corpus_files", "load_data",
           "load_tokens", "run_vocab"]


def load_tokens(path: str | Path) -> np.ndarray:
    """All bytes of a text corpus as uint8 token ids, in memory (files in order, joined by a
    newline): the byte tokenizer's stream without the cache, for references and tests."""
    chunks = token_stream(corpus_files(path), ByteTokenizer(), "text", ReadStats())
    return np.concatenate([c.astype(np.uint8) for c in chunks] or [np.zeros(0, np.uint8)])


def run_vocab(spec: ModelSpec, tok: TokenizerId) -> int:
    """The model's vocab_size in this run: the tokenizer file's, or the preset's with bytes."""
    return spec.vocab_size if tok == BYTES_ID else tok.vocab_size


def load_data(cfg: DataConfig, spec: ModelSpec, seed: int,
              log: Callable[[str], None] = print) -> TextData | FakeData:
    """The run's data (--data/--tokenizer/--fake-data), saying what it read."""
    tok = load_tokenizer(cfg.tokenizer or "bytes")
    vocab = run_vocab(spec, tok.ident)
    if vocab != spec.vocab_size:
        log(f"model vocab {vocab} from --tokenizer {cfg.tokenizer} (the preset {spec.name} "
            f"has {spec.vocab_size}; the plan's memory and FLOPs figures assumed that); its "
            f"embedding needs {vocab_memory(vocab, spec.d_model)} of training memory")
    if cfg.fake_data:
        return FakeData(spec.seq_len, vocab, seed=seed, tokenizer=tok.ident)
    files = corpus_files(cfg.data or DEFAULT_CORPUS)
    corpus = open_tokens(files, tok, cfg.text_field,
                         Path(cfg.token_cache) if cfg.token_cache else None)
    info = corpus.info
    skipped = (f", {info['skipped']} record(s) without {cfg.text_field!r} skipped"
               if info["skipped"] else "")
    how = (f"tokenized in {corpus.built_s:.1f} s" if corpus.built_s is not None
           else "reused")
    log(f"data: {info['tokens']} tokens ({tok.ident.name}) from {len(files)} file(s), "
        f"{info['documents']} document(s){skipped}; token cache {corpus.path} ({how})")
    return TextData(corpus.tokens, spec.seq_len, vocab, seed=seed, tokenizer=tok.ident)


class TextData:
    """Fixed-length windows of a token array (e.g. the cache's memmap, which stays on disk:
    only the windows a step reads are copied), split into train and validation."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int,
                 val_every: int = 20, seed: int = 0, tokenizer: TokenizerId = BYTES_ID) -> None:
        """`vocab_size`: the model's (embedding rows); `tokenizer`: what made `tokens`."""
        if vocab_size < tokenizer.vocab_size:
            raise UserError(f"data: the {tokenizer.name} tokenizer needs vocab_size >= "
                            f"{tokenizer.vocab_size}, model has {vocab_size}")
        n = (len(tokens) - 1) // seq_len
        if n < 2 * val_every:
            raise UserError(f"data: corpus too small ({len(tokens)} tokens) for sequences of "
                            f"{seq_len}: it needs {2 * val_every * seq_len + 1} tokens or more "
                            f"({2 * val_every} windows, every {val_every}th held out)")
        self.tokens = tokens
        self.seq_len, self.seed, self.vocab_size = seq_len, seed, vocab_size
        self.tokenizer = tokenizer
        """Identity of the tokenizer (checkpoint meta)."""
        starts = np.arange(n) * seq_len
        is_val = (np.arange(n) % val_every) == val_every - 1
        self.train_starts, self.val_starts = starts[~is_val], starts[is_val]
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len + 1
        w = np.empty((len(starts), t), dtype=np.int64)
        for i, s in enumerate(starts):  # slices of the memmap: reads only these pages
            w[i] = self.tokens[s:s + t]
        w = torch.from_numpy(w)
        return w[:, :-1], w[:, 1:]

    def _train_start(self, g: int) -> int:
        n = len(self.train_starts)
        epoch, pos = divmod(g, n)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(n)
            self._perm_epoch = epoch
        return int(self.train_starts[self._perm[pos]])

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global training samples [first, first+count): (inputs, targets), each (count, T)."""
        return self._windows(np.array([self._train_start(g) for g in
                                       range(first, first + count)], dtype=np.int64))

    def val_batches(self, num_sequences: int, batch: int) -> list[tuple[torch.Tensor, ...]]:
        """The first `num_sequences` validation windows, in batches of `batch` (fixed set)."""
        starts = self.val_starts[:num_sequences]
        x, y = self._windows(starts)
        return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(starts), batch)
                if i + batch <= len(starts)]


class FakeData:
    """Seeded random tokens with the same interface as TextData, for speed tests."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0,
                 tokenizer: TokenizerId = BYTES_ID) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.tokenizer = tokenizer
        """Identity of the tokenizer whose vocabulary the model has (checkpoint meta)."""

    def _rand(self, keys: range) -> tuple[torch.Tensor, torch.Tensor]:
        # one generator per sample, so a sample does not depend on how batches are cut
        w = torch.stack([
            torch.randint(0, self.vocab_size, (self.seq_len + 1,),
                          generator=torch.Generator().manual_seed(self.seed * 1_000_003 + k))
            for k in keys])
        return w[:, :-1], w[:, 1:]

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (inputs, targets) of global samples [first, first+count)."""
        return self._rand(range(first, first + count))

    def val_batches(self, num_sequences: int, batch: int) -> list[tuple[torch.Tensor, ...]]:
        """Fixed random validation batches."""
        x, y = self._rand(range(-num_sequences, 0))
        return [(x[i:i + batch], y[i:i + batch]) for i in range(0, num_sequences, batch)
                if i + batch <= num_sequences]


class Sharder:
    """Which global samples replica r's micro-batches of step k hold."""

    def __init__(self, data: TextData | FakeData, num_replicas: int, num_micro_batches: int,
                 micro_batch_size: int) -> None:
        self.data, self.R, self.M, self.b = data, num_replicas, num_micro_batches, micro_batch_size

    @property
    def global_batch(self) -> int:
        """Sequences per step over all replicas."""
        return self.R * self.M * self.b

    def micro_batches(self, step: int, replica: int) -> tuple[list[torch.Tensor], ...]:
        """(inputs, targets) lists of M micro-batches of (b, T) for `replica` at `step`."""
        first = step * self.global_batch + replica * self.M * self.b
        x, y = self.data.samples(first, self.M * self.b)
        return list(x.split(self.b)), list(y.split(self.b))
