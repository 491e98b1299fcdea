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
from formats.safe_open import read_bytes

MAX_VOCAB = 1 << 20
"""Largest vocabulary accepted (as scripts/train_tokenizer.py): 2M tokens would need 33 GB of
training memory for the embedding of a 1,024-wide model, and ~30 s just to load the file."""
MAX_TOKENIZER_BYTES = 256 << 20
"""Largest tokenizer file read (a 1M-token vocabulary with merges is ~60 MB)."""
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
        except BaseException as e:  # plain Exception for bad JSON, PanicException (Rust)
            _reraise_interrupts(e)
            raise UserError(f"--tokenizer {path}: not a Hugging Face tokenizers JSON file "
                            f"({_first_line(e)}); make one with "
                            "scripts/train_tokenizer.py or pass --tokenizer bytes") from None
        vocab = self.tok.get_vocab_size(with_added_tokens=True)
        if vocab < 1:
            raise UserError(f"--tokenizer {path}: has an empty vocabulary")
        if vocab > MAX_VOCAB:
            raise _too_many(vocab, path)
        # A stream of whole documents is tokenized: the file's inference settings would pad
        # every piece (Fixed 4M: 8M tokens of 10 KB) or cut it (to 0: "no text").
        self.tok.no_padding()
        self.tok.no_truncation()
        self.path = path
        self.ident = TokenizerId(path.name, vocab, hashlib.sha256(raw).hexdigest())

    def separator(self) -> np.ndarray:
        """Tokens between two documents: <|endoftext|> if known, else those of a newline."""
        eot = self.tok.token_to_id(END_OF_TEXT)
        ids = [eot] if eot is not None else self.tok.encode("\n", add_special_tokens=False).ids
        return np.array(ids, dtype=np.int64)

    def encode(self, pieces: list[bytes], where: str) -> list[np.ndarray]:
        """Token ids of each UTF-8 piece (UserError naming `where` for bytes that are not)."""
        texts = [_utf8(p, where) for p in pieces]
        try:
            encoded = self.tok.encode_batch(texts, add_special_tokens=False)
        except BaseException as e:  # e.g. WordLevel without unk_token, a Rust panic
            _reraise_interrupts(e)
            raise UserError(f"--tokenizer {self.path}: cannot encode {where} "
                            f"({_first_line(e)}); fix the tokenizer file (e.g. give WordLevel "
                            "an unk_token) or pass --tokenizer bytes") from None
        return [np.array(e.ids, dtype=np.int64) for e in encoded]


Tokenizer = ByteTokenizer | HFTokenizer


def vocab_memory(vocab: int, d_model: int = 1024) -> str:
    """Training memory of a vocab x d_model embedding (fp32 weights, gradients and AdamW's
    two moments: 16 bytes a parameter), e.g. '32.0 GB'."""
    return f"{vocab * d_model * 16 / 1e9:.1f} GB"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def _reraise_interrupts(e: BaseException) -> None:
    """Re-raise what is no tokenizer error: Ctrl-C, exit (a Rust panic is a BaseException)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, UserError)):
        raise e


def _too_many(vocab: int, path: Path) -> UserError:
    return UserError(f"--tokenizer {path}: {vocab} tokens, more than the {MAX_VOCAB} a model "
                     f"here may have (its embedding alone: {vocab_memory(vocab)} of training "
                     "memory per 1,024 model dimensions); use a smaller vocabulary")


def _read(path: Path) -> bytes:
    if not path.exists():
        raise UserError(f"--tokenizer {path}: no such file; pass `bytes` or a tokenizer.json "
                        "(make one with scripts/train_tokenizer.py)")
    return read_bytes(path, "--tokenizer", MAX_TOKENIZER_BYTES)


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
