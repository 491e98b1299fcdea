"""Training text: a byte-level tokenizer, a deterministic train/validation split and sharding.

The default corpus is Debian's `fortunes` (+ `fortunes-min`), installed by the project's setup
from the Debian archive: ~2.7 MB of English text under /usr/share/games/fortunes. Any text file
or folder works with --data. Tokens are bytes (vocab 256), so no tokenizer has to be trained or
downloaded.

Windows of seq_len + 1 tokens (inputs and shifted targets) start every seq_len bytes; every
`val_every`-th window is held out for validation. Step `k` of a run with R replicas, M
micro-batches and micro-batch size b uses global samples [k*R*M*b, (k+1)*R*M*b) of a seeded
permutation of the training windows (a new permutation each epoch); replica r takes the r-th
contiguous slice, so the concatenation over replicas is the global batch a single process would
see, and the position in the data is a pure function of the step (checkpoints store the step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from formats.errors import UserError

DEFAULT_CORPUS = Path("/usr/share/games/fortunes")
SKIP_SUFFIXES = (".dat", ".u8")  # strfile indexes and UTF-8 symlinks to the same text


def corpus_files(path: str | Path) -> list[Path]:
    """Text files of a corpus path (a file, or a folder's files without index duplicates)."""
    path = Path(path)
    if not path.exists():
        hint = (" (install it with: apt-get install fortunes fortunes-min)"
                if path == DEFAULT_CORPUS else "")
        raise UserError(f"data: {path} does not exist{hint}; pass --data FILE|FOLDER with "
                        "text, or --fake-data for random tokens")
    if path.is_file():
        return [path]
    seen: set[Path] = set()
    files = []
    for f in sorted(path.rglob("*")):
        if not f.is_file() or f.name.startswith(".") or f.suffix in SKIP_SUFFIXES:
            continue
        real = f.resolve()
        if real not in seen:
            seen.add(real)
            files.append(f)
    if not files:
        raise UserError(f"data: no text files in {path}")
    return files


def load_tokens(path: str | Path) -> np.ndarray:
    """All bytes of the corpus as uint8 token ids (files in sorted order, joined by a newline)."""
    chunks = []
    for f in corpus_files(path):
        try:
            chunks.append(f.read_bytes())
        except OSError as e:
            raise UserError(f"data: cannot read {f}: {e.strerror}") from None
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


class TextData:
    """Fixed-length windows of a token array, split into train and validation."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int,
                 val_every: int = 20, seed: int = 0) -> None:
        if vocab_size < 256:
            raise UserError(f"data: the byte tokenizer needs vocab_size >= 256, model has "
                            f"{vocab_size}")
        n = (len(tokens) - 1) // seq_len
        if n < 2 * val_every:
            raise UserError(f"data: corpus too small ({len(tokens)} tokens) for sequences of "
                            f"{seq_len}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.seed = seq_len, seed
        starts = np.arange(n) * seq_len
        is_val = (np.arange(n) % val_every) == val_every - 1
        self.train_starts, self.val_starts = starts[~is_val], starts[is_val]
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)
        w = self.tokens[idx]
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

    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

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
