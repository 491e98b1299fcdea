"""The token cache: a corpus tokenized once into a flat file of token ids, then memory-mapped.

The file is `<key>.<dtype>` in the cache folder (--token-cache, default
~/.cache/scattered-train/tokens), next to `<key>.json` (token and document counts). The key
hashes the cache format, the tokenizer's identity, --text-field and every corpus file's
resolved path, size and modification time: change any and the corpus is tokenized again; the
next run (and the other ranks on the host) reuse it. Ids are uint8/uint16/uint32, the smallest
that holds the vocabulary. Building streams file by file, piece by piece (modules.data.corpus) into
a temp file that is renamed into place (formats.atomic_io), under an exclusive lock on
`<key>.lock`, so ranks that start together tokenize once and never read a half-written file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from formats.atomic_io import atomic_write_json, atomic_write_with
from formats.errors import UserError
from modules.data.corpus import ReadStats, documents, pieces
from modules.data.tokenizer import Tokenizer

CACHE_FORMAT = "tokens/1"
BATCH_BYTES = 1 << 20
"""Text bytes encoded per tokenizer call (tokenizers parallelises over a batch's pieces)."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/scattered-train/tokens (default ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no $HOME and no passwd entry
            base = Path(tempfile.gettempdir()) / f"cache-{os.getuid()}"
    return Path(base) / "scattered-train" / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id."""
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else
                    np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def cache_key(files: list[Path], tok: Tokenizer, field: str) -> str:
    """Hash of what the cached ids depend on (see the module doc)."""
    ident = {"format": CACHE_FORMAT, "tokenizer": tok.ident.meta(), "field": field,
             "files": [_file_id(f) for f in files]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _file_id(f: Path) -> list[Any]:
    st = f.stat()
    return [str(f.resolve()), st.st_size, st.st_mtime_ns]


def token_stream(files: list[Path], tok: Tokenizer, field: str,
                 stats: ReadStats) -> Iterator[np.ndarray]:
    """Token ids of the corpus in chunks: the documents of every file in order, with the
    tokenizer's separator between two documents."""
    sep, first = tok.separator(), True
    for path in files:
        batch: list[bytes | None] = []  # None: a document boundary
        size = 0
        for doc in documents(path, field, stats):
            if not first:
                batch.append(None)
            first = False
            for piece in pieces(doc):
                batch.append(piece)
                size += len(piece)
                if size >= BATCH_BYTES:
                    yield from _encode(batch, tok, sep, str(path))
                    batch, size = [], 0
        yield from _encode(batch, tok, sep, str(path))


def _encode(batch: list[bytes | None], tok: Tokenizer, sep: np.ndarray,
            where: str) -> Iterator[np.ndarray]:
    ids = iter(tok.encode([p for p in batch if p is not None], where))
    for p in batch:
        yield sep if p is None else next(ids)


@dataclass
class CorpusTokens:
    """A tokenized corpus: its ids (memory-mapped, read-only) and where they came from."""

    tokens: np.ndarray
    """np.memmap of the ids."""
    path: Path
    """The cache file."""
    info: dict[str, Any]
    """tokens, documents, skipped, files, tokenizer (the sidecar JSON)."""
    built_s: float | None
    """Seconds this process spent tokenizing (None: reused)."""


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _read_info(meta: Path, data: Path, itemsize: int) -> dict[str, Any] | None:
    """The sidecar if it and the ids file agree (a complete earlier build), else None."""
    try:
        info = json.loads(meta.read_text())
        ok = info["tokens"] * itemsize == data.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if ok else None


def _build(files: list[Path], tok: Tokenizer, field: str, data: Path, meta: Path,
           dtype: np.dtype) -> dict[str, Any]:
    stats, count = ReadStats(), 0
    vocab = tok.ident.vocab_size

    def write(f: BinaryIO) -> None:
        nonlocal count
        for ids in token_stream(files, tok, field, stats):
            if len(ids) and int(ids.max()) >= vocab:  # a tokenizer bug would wrap silently
                raise UserError(f"--tokenizer: produced id {int(ids.max())} >= its vocab_size "
                                f"{vocab}")
            f.write(ids.astype(dtype, copy=False).tobytes())
            count += len(ids)
        if count == 0:  # raised inside the write: no cache file is left for it
            raise _no_text(files, stats.skipped, field)

    atomic_write_with(data, write)
    info = {"format": CACHE_FORMAT, "tokens": count, "documents": stats.documents,
            "skipped": stats.skipped, "files": [str(f) for f in files],
            "tokenizer": {"name": tok.ident.name, **tok.ident.meta()}}
    atomic_write_json(meta, info)
    return info


def open_tokens(files: list[Path], tok: Tokenizer, field: str,
                cache_dir: Path | None = None) -> CorpusTokens:
    """The corpus's ids from the cache, tokenized first if not there (see the module doc)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = cache_key(files, tok, field)
        dtype = token_dtype(tok.ident.vocab_size)
        data, meta = folder / f"{key}.{dtype.name}", folder / f"{key}.json"
        with _locked(folder / f"{key}.lock"):
            info, built_s = _read_info(meta, data, dtype.itemsize), None
            if info is None:
                t0 = time.perf_counter()
                info = _build(files, tok, field, data, meta, dtype)
                built_s = time.perf_counter() - t0
    except OSError as e:
        raise UserError(f"--token-cache {folder}: cannot write the token cache there "
                        f"({e.strerror or e}); pass a writable folder") from None
    if info["tokens"] == 0:  # an empty cache written before empty corpora were refused
        raise _no_text(files, info["skipped"], field)
    tokens = np.memmap(data, dtype=dtype, mode="r", shape=(info["tokens"],))
    return CorpusTokens(tokens, data, info, built_s)


def _no_text(files: list[Path], skipped: int, field: str) -> UserError:
    return UserError(f"data: the corpus ({_names(files)}) holds no text"
                     + (f"; {skipped} record(s) had no {field!r} field (pick the field with "
                        "--text-field)" if skipped else ""))


def _names(files: list[Path]) -> str:
    shown = ", ".join(str(f) for f in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")
