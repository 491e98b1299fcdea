"""Corpus files: which files --data names, and their documents, streamed as UTF-8 byte pieces.

`--data` is one or more comma-separated files, folders or globs (quote globs for the shell).
Per file, by suffix:
- no suffix, `.txt`, `.text`, `.md`: one document, the file's bytes;
- `.jsonl`: one document per line's `--text-field` (default `text`) string; blank lines, lines
  whose JSON has no such field (or null) are skipped and counted; a line that is not JSON, or a
  field that is not a string, is an error naming file:line;
- `.parquet`: one document per row of the `--text-field` string column (nulls skipped).
Folders are read recursively in sorted order, without dotfiles, strfile indexes (`.dat`) and
the `.u8` symlinks of Debian's fortunes; any other suffix is an error. A file named twice (or
through a symlink) is read once.

A document is read as lines of at most LINE_BYTES, grouped into pieces of about PIECE_BYTES
that end at a line end (or a UTF-8 character boundary inside a long line). The pieces depend only
on the document's bytes, so the same text tokenizes the same whether it comes from a .txt
file, a jsonl record or a parquet row; nothing holds more than one piece and one record.
"""

from __future__ import annotations

import glob
import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from formats.errors import UserError
from formats.safe_open import check_regular, open_regular

DEFAULT_CORPUS = Path("/usr/share/games/fortunes")
TEXT_SUFFIXES = ("", ".txt", ".text", ".md")
SKIP_SUFFIXES = (".dat", ".u8")  # strfile indexes and UTF-8 symlinks to the same text
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
LINE_BYTES = 1 << 20
"""Longest line read at once; longer lines are read in parts."""
PIECE_BYTES = 1 << 13
"""A piece closes at the first line end after this many bytes."""
_GLOB_CHARS = "*?["


@dataclass
class ReadStats:
    """What reading the corpus found (reported in the run's log line)."""

    documents: int = 0
    """Documents read (files, records, rows)."""
    skipped: int = 0
    """jsonl lines / parquet rows without the text field (or null)."""


def _kind(path: Path, where: str) -> str:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in (".jsonl", ".parquet"):
        return suffix[1:]
    raise UserError(f"data: {path}{where}: unsupported suffix {suffix!r}; --data reads text "
                    "(.txt or no suffix), .jsonl and .parquet files")


def _expand(item: str) -> list[Path]:
    """The files one --data item names (a file, a folder's files, a glob's matches)."""
    path = Path(item)
    if not path.exists() and any(c in item for c in _GLOB_CHARS):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            raise UserError(f"data: the glob {item!r} matches no file; pass --data "
                            "FILE|FOLDER|GLOB[,...]")
        return [f for m in matches for f in _expand(m)]
    if not path.exists():
        hint = (" (install it with: apt-get install fortunes fortunes-min)"
                if path == DEFAULT_CORPUS else "")
        raise UserError(f"data: {path} does not exist{hint}; pass --data FILE|FOLDER|GLOB[,...] "
                        "with text, or --fake-data for random tokens")
    if path.is_file():
        _kind(path, "")
        return [path]
    files = [f for f in sorted(path.rglob("*")) if f.is_file()
             and not f.name.startswith(".") and f.suffix not in SKIP_SUFFIXES]
    for f in files:
        _kind(f, f" (in folder {path})")
    if not files:
        raise UserError(f"data: no text files in {path}")
    return files


def data_items(value: str | Path) -> list[str]:
    """--data's items: comma-separated, unless the whole value is an existing path."""
    text = str(value)
    if Path(text).exists() or "," not in text:
        return [text]
    return [v for v in (s.strip() for s in text.split(",")) if v]


def corpus_files(value: str | Path) -> list[Path]:
    """The files of --data (items in order, each folder/glob sorted), each file once."""
    items = data_items(value)
    if not items or items == [""]:  # Path("") is the current folder: never what was meant
        raise UserError(f"data: --data {str(value)!r} names no file, folder or glob; pass "
                        "--data FILE|FOLDER|GLOB[,...]")
    seen: set[Path] = set()
    out = []
    for item in items:
        for f in _expand(item):
            real = f.resolve()
            if real not in seen:
                seen.add(real)
                out.append(f)
    return out


def _lines(read: Callable[[int], bytes]) -> Iterator[bytes]:
    while line := read(LINE_BYTES):
        yield line


def _utf8_end(buf: bytearray) -> int:
    """Length of `buf` without a UTF-8 character cut at its end."""
    for k in range(1, min(4, len(buf)) + 1):
        b = buf[-k]
        if b < 0x80:
            return len(buf)
        if b >= 0xC0:  # the lead byte of the last character: is it complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(buf) if k >= need else len(buf) - k
    return len(buf)


def pieces(lines: Iterable[bytes]) -> Iterator[bytes]:
    """Consecutive lines grouped into pieces of about PIECE_BYTES (see the module doc)."""
    buf = bytearray()
    for line in lines:
        buf += line
        if len(buf) >= PIECE_BYTES:
            cut = len(buf) if buf.endswith(b"\n") else _utf8_end(buf)
            yield bytes(buf[:cut])
            del buf[:cut]
    if buf:
        yield bytes(buf)


def _text_doc(text: str) -> Iterator[bytes]:
    # lone surrogates (possible in JSON) have no UTF-8 form: replaced, like any decoder would
    return _lines(io.BytesIO(text.encode("utf-8", "replace")).readline)


def _read_error(path: Path, e: OSError) -> UserError:
    return UserError(f"data: cannot read {path}: {e.strerror or e}")


def _text_docs(path: Path, field: str, stats: ReadStats) -> Iterator[Iterator[bytes]]:
    try:
        with open_regular(path, "data file") as f:
            stats.documents += 1
            yield _lines(f.readline)
    except OSError as e:
        raise _read_error(path, e) from None


def _jsonl_docs(path: Path, field: str, stats: ReadStats) -> Iterator[Iterator[bytes]]:
    try:
        with open_regular(path, "data file") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                    raise UserError(f"data: {path}:{lineno}: not JSON ({e})") from None
                except RecursionError:
                    raise UserError(f"data: {path}:{lineno}: JSON nested too deep; a record "
                                    "is one object per line") from None
                text = rec.get(field) if isinstance(rec, dict) else None
                if text is None:
                    stats.skipped += 1
                    continue
                if not isinstance(text, str):
                    raise UserError(f"data: {path}:{lineno}: field {field!r} is "
                                    f"{type(text).__name__}, not a string")
                stats.documents += 1
                yield _text_doc(text)
    except OSError as e:
        raise _read_error(path, e) from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _parquet_column(pf: object, path: Path, field: str) -> None:
    """UserError unless `field` is exactly one column of strings (plain, large or
    dictionary-encoded: all ordinary text)."""
    import pyarrow as pa

    schema = pf.schema_arrow  # type: ignore[attr-defined]
    found = schema.get_all_field_indices(field)
    if not found:
        raise UserError(f"data: {path}: no column {field!r} (columns: "
                        f"{', '.join(schema.names)}); name the text column with --text-field")
    if len(found) > 1:
        raise UserError(f"data: {path}: {len(found)} columns are named {field!r}; a parquet "
                        "corpus needs one text column (rewrite the file with unique names)")
    kind = schema.field(found[0]).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        raise UserError(f"data: {path}: column {field!r} holds {kind}, not strings")


def _parquet_docs(path: Path, field: str, stats: ReadStats) -> Iterator[Iterator[bytes]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_regular(path, "data file")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"data: {path}: not a readable parquet file ({_one_line(e)})") from None
    _parquet_column(pf, path, field)
    batches = pf.iter_batches(batch_size=1024, columns=[field])
    while True:
        try:  # a corrupt page or a cut file shows only here: its error, not the cache's
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"data: {path}: damaged parquet file ({_one_line(e)}); "
                            "rewrite it or leave it out of --data") from None
        for text in batch.column(0).to_pylist():
            if text is None:
                stats.skipped += 1
                continue
            stats.documents += 1
            yield _text_doc(text)


_READERS = {"text": _text_docs, "jsonl": _jsonl_docs, "parquet": _parquet_docs}


def documents(path: Path, field: str, stats: ReadStats) -> Iterator[Iterator[bytes]]:
    """The documents of one corpus file, each as its lines (bytes), streamed."""
    return _READERS[_kind(path, "")](path, field, stats)
