"""The token cache: a corpus tokenized once into a flat file of token ids, then memory-mapped.

The file is `<key>.<dtype>` in the cache folder (--token-cache, default
~/.cache/scattered-train/tokens), next to `<key>.json` (token and document counts). The key
hashes the cache format, the tokenizer's identity, --text-field and every corpus file's
resolved path, size and modification time: change any and the corpus is tokenized again; the
next run (and the other ranks on the host) reuse it. Ids are uint8/uint16/uint32, the smallest
that holds the vocabulary. Building streams file by file, piece by piece (modules.data.corpus) into
a temp file that is renamed into place (formats.atomic_io), under an exclusive lock on
`<key>.lock`, so ranks that start together tokenize once and never read a half-written file.
The sidecar also keeps the ids' sha256 and largest id: a reused cache is checked against them
(and the id range against the tokenizer's vocabulary) before training, so ids changed on disk
are refused with a message instead of an IndexError mid-training.
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
from formats.safe_open import check_regular, open_regular, read_bytes
from modules.data.corpus import ReadStats, documents, pieces
from modules.data.tokenizer import Tokenizer

CACHE_FORMAT = "tokens/1"
MAX_SIDECAR_BYTES = 1 << 20
"""Largest sidecar JSON read (a few hundred bytes, plus the corpus file names)."""
SCAN_BYTES = 16 << 20
"""Ids read at once when checking a cache file against its sidecar."""
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


def _read_info(meta: Path, data: Path, dtype: np.dtype, vocab: int) -> dict[str, Any] | None:
    """The sidecar of a complete earlier build after the ids file passed its check, or None
    (no build yet, or one of an older cache format: build again); UserError naming both files
    when the ids or the sidecar were changed since (size, sha256, id range)."""
    if not (meta.exists() and data.exists()):  # not built, or a build cut short: build
        return None
    try:
        info = json.loads(read_bytes(meta, "token cache sidecar", MAX_SIDECAR_BYTES))
    except (UserError, ValueError, RecursionError):
        info = None
    if isinstance(info, dict) and info.get("format") == CACHE_FORMAT and "sha256" not in info:
        return None  # written before the checksum was kept: tokenize again, once
    why = _sidecar_problem(info, vocab)
    if why is None:
        why = _ids_problem(data, dtype, info)  # type: ignore[arg-type]
    if why is not None:
        raise UserError(f"--token-cache: {data} does not match its sidecar {meta} ({why}); "
                        "it was changed after it was written: delete both files and the "
                        "corpus is tokenized again")
    return info  # type: ignore[return-value]


def _sidecar_problem(info: Any, vocab: int) -> str | None:
    """Why a sidecar is unusable, or None."""
    if not isinstance(info, dict) or info.get("format") != CACHE_FORMAT:
        return f"the sidecar is missing, unreadable or not {CACHE_FORMAT}"
    for key in ("tokens", "documents", "skipped", "max_id"):
        v = info.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"sidecar field {key!r} is {v!r}, not a count"
    if info["max_id"] >= vocab:
        return f"sidecar max_id {info['max_id']} >= the tokenizer's vocab_size {vocab}"
    if not isinstance(info.get("sha256"), str):
        return "sidecar field 'sha256' is not text"
    return None


def _ids_problem(data: Path, dtype: np.dtype, info: dict[str, Any]) -> str | None:
    """Why the ids file disagrees with its sidecar (size, sha256, largest id), or None."""
    size = check_regular(data, "--token-cache ids file").st_size
    if size != info["tokens"] * dtype.itemsize:
        return f"{size} bytes, the sidecar says {info['tokens']} tokens of {dtype.itemsize} B"
    digest, top = _scan(data, dtype)
    if digest != info["sha256"]:
        return "sha256 of the ids differs from the sidecar's"
    if top != info["max_id"]:
        return f"largest id {top}, the sidecar says {info['max_id']}"
    return None


def _scan(data: Path, dtype: np.dtype) -> tuple[str, int]:
    """sha256 and largest id of an ids file, read in chunks (about 1 s per GB)."""
    h, top = hashlib.sha256(), 0
    with open_regular(data, "--token-cache ids file") as f:
        while chunk := f.read(SCAN_BYTES):
            h.update(chunk)
            ids = np.frombuffer(chunk[:len(chunk) // dtype.itemsize * dtype.itemsize], dtype)
            top = max(top, int(ids.max())) if len(ids) else top
    return h.hexdigest(), top


def _build(files: list[Path], tok: Tokenizer, field: str, data: Path, meta: Path,
           dtype: np.dtype) -> dict[str, Any]:
    stats, count, top, h = ReadStats(), 0, 0, hashlib.sha256()
    vocab = tok.ident.vocab_size

    def write(f: BinaryIO) -> None:
        nonlocal count, top
        for ids in token_stream(files, tok, field, stats):
            if len(ids) and int(ids.max()) >= vocab:  # a tokenizer bug would wrap silently
                raise UserError(f"--tokenizer: produced id {int(ids.max())} >= its vocab_size "
                                f"{vocab}")
            raw = ids.astype(dtype, copy=False).tobytes()
            f.write(raw)
            h.update(raw)
            count += len(ids)
            top = max(top, int(ids.max())) if len(ids) else top
        if count == 0:  # raised inside the write: no cache file is left for it
            raise _no_text(files, stats.skipped, field)

    atomic_write_with(data, write)
    info = {"format": CACHE_FORMAT, "tokens": count, "documents": stats.documents,
            "skipped": stats.skipped, "files": [str(f) for f in files],
            "tokenizer": {"name": tok.ident.name, **tok.ident.meta()},
            "sha256": h.hexdigest(), "max_id": top}
    atomic_write_json(meta, info)
    return info


def open_tokens(files: list[Path], tok: Tokenizer, field: str,
                cache_dir: Path | None = None) -> CorpusTokens:
    """The corpus's ids from the cache (checked against its sidecar), tokenized first if not
    there (see the module doc)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = cache_key(files, tok, field)
        dtype = token_dtype(tok.ident.vocab_size)
        data, meta = folder / f"{key}.{dtype.name}", folder / f"{key}.json"
        with _locked(folder / f"{key}.lock"):
            info = _read_info(meta, data, dtype, tok.ident.vocab_size)
            built_s = None
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
