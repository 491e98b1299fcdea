"""Tokenizers of the runtime: raw bytes (vocab 256, the default) or a local Hugging Face
`tokenizers` file (`tokenizer.json`, e.g. from scripts/train_tokenizer.py). Never the hub.

A tokenizer turns UTF-8 byte pieces of a document into token ids, and names the tokens that
separate two documents: `<|endoftext|>` when its vocabulary has it, else the tokens of "\\n"
(the byte tokenizer: byte 10, so a folder of text files reads as the files joined by newlines).
Its identity (name, vocab_size, sha256 of the file) goes into the token cache's key and every
checkpoint's meta, so a run never resumes or reads tokens of another vocabulary.
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import UserError

BYTES = "bytes"
"""--tokenizer value of the byte tokenizer."""
END_OF_TEXT = "<|endoftext|>"
"""Special token that separates documents when a tokenizer has it (scripts/train_tokenizer.py
adds it)."""


@dataclass(frozen=True)
class TokenizerId:
    """What identifies a tokenizer's ids: same identity, same ids for the same text."""

    name: str
    """`bytes`, or the tokenizer file's name (for messages only; not compared)."""
    vocab_size: int
    """Number of token ids (the model's embedding rows follow it)."""
    sha256: str
    """sha256 of the tokenizer file (`bytes` for the byte tokenizer)."""

    def meta(self) -> dict[str, Any]:
        """The checkpoint meta entry (the name is left out: renaming a file changes no id)."""
        return {"vocab_size": self.vocab_size, "sha256": self.sha256}


BYTES_ID = TokenizerId(BYTES, 256, BYTES)


class ByteTokenizer:
    """Token = byte: no file, no training, vocab 256; text need not be UTF-8."""

    ident = BYTES_ID

    def separator(self) -> np.ndarray:
        """Tokens between two documents: a newline."""
        return np.array([10], dtype=np.int64)

    def encode(self, pieces: list[bytes], where: str) -> list[np.ndarray]:
        """Token ids of each byte piece."""
        return [np.frombuffer(p, dtype=np.uint8) for p in pieces]


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file, loaded locally; encodes without special tokens."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--tokenizer: the `tokenizers` package is not installed (pip "
                            "install tokenizers, or bash scripts/setup_env.sh)") from None
        raw = _read(path)
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception for any bad JSON
            raise UserError(f"--tokenizer {path}: not a Hugging Face tokenizers JSON file "
                            f"({str(e).splitlines()[0][:200]}); make one with "
                            "scripts/train_tokenizer.py or pass --tokenizer bytes") from None
        vocab = self.tok.get_vocab_size(with_added_tokens=True)
        if vocab < 1:
            raise UserError(f"--tokenizer {path}: has an empty vocabulary")
        self.ident = TokenizerId(path.name, vocab, hashlib.sha256(raw).hexdigest())

    def separator(self) -> np.ndarray:
        """Tokens between two documents: <|endoftext|> if known, else those of a newline."""
        eot = self.tok.token_to_id(END_OF_TEXT)
        ids = [eot] if eot is not None else self.tok.encode("\n", add_special_tokens=False).ids
        return np.array(ids, dtype=np.int64)

    def encode(self, pieces: list[bytes], where: str) -> list[np.ndarray]:
        """Token ids of each UTF-8 piece (UserError naming `where` for bytes that are not)."""
        texts = [_utf8(p, where) for p in pieces]
        return [np.array(e.ids, dtype=np.int64)
                for e in self.tok.encode_batch(texts, add_special_tokens=False)]


Tokenizer = ByteTokenizer | HFTokenizer


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise UserError(f"--tokenizer {path}: no such file; pass `bytes` or a tokenizer.json "
                        "(make one with scripts/train_tokenizer.py)")
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"--tokenizer {path}: cannot read it ({e.strerror})") from None


def _utf8(piece: bytes, where: str) -> str:
    try:
        return codecs.decode(piece, "utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"data: {where}: not UTF-8 text (byte 0x{piece[e.start]:02x}); a "
                        "tokenizer file needs UTF-8, --tokenizer bytes reads any bytes") from None


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes` or the path of a tokenizer.json (UserError naming --tokenizer when unusable)."""
    if spec == BYTES:
        return ByteTokenizer()
    return HFTokenizer(Path(spec))
