"""Train a small byte-level BPE tokenizer on a corpus, for runs that have no tokenizer.json.

    python scripts/train_tokenizer.py --data /usr/share/games/fortunes --vocab-size 1024 \
        --out tokenizer.json
    python dist_runner.py ... --data CORPUS --tokenizer tokenizer.json

Reads --data like dist_runner.py does (files, folders, globs of .txt/.jsonl/.parquet; see
modules/data/corpus.py), streamed, and trains the Hugging Face `tokenizers` BPE on it: GPT-2 style
byte-level pre-tokenization (any text round-trips, no unknown token), the 256 byte symbols,
`<|endoftext|>` (which the runtime puts between documents) and merges up to --vocab-size.
Runs locally, offline. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

from formats import argtypes  # noqa: E402
from formats.atomic_io import atomic_write_bytes, check_output_path  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from modules.data.corpus import ReadStats, corpus_files, documents, pieces  # noqa: E402
from modules.data.tokenizer import END_OF_TEXT  # noqa: E402

MIN_VOCAB = 257
"""The 256 byte symbols and <|endoftext|>."""
MAX_VOCAB = 1 << 20


def texts(files: list[Path], field: str, stats: ReadStats) -> Iterator[str]:
    """The corpus as text pieces (bytes that are not UTF-8 are replaced, for training only)."""
    for path in files:
        for doc in documents(path, field, stats):
            for piece in pieces(doc):
                yield piece.decode("utf-8", "replace")


def train(files: list[Path], vocab_size: int, field: str = "text") -> tuple[object, ReadStats]:
    """A trained byte-level BPE `tokenizers.Tokenizer` and what was read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    stats, chars = ReadStats(), 0

    def counted() -> Iterator[str]:
        nonlocal chars
        for text in texts(files, field, stats):
            chars += len(text)
            yield text

    tok.train_from_iterator(counted(), trainer=trainer)
    if chars == 0:  # empty files, or records without the field: nothing was learnt
        raise UserError(f"--data: the corpus holds no text ({stats.documents} document(s))"
                        + (f"; {stats.skipped} record(s) had no {field!r} field (pick the "
                           "field with --text-field)" if stats.skipped else ""))
    return tok, stats


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, train, write --out atomically."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help="comma-separated text/.jsonl/.parquet files, folders or quoted globs")
    p.add_argument("--vocab-size", type=argtypes.integer(MIN_VOCAB, MAX_VOCAB), default=1024,
                   help="vocabulary size, byte symbols and <|endoftext|> included "
                        "(default 1024)")
    p.add_argument("--text-field", default="text",
                   help="text field of .jsonl records / column of .parquet files")
    p.add_argument("--out", required=True, help="tokenizer.json to write")
    args = p.parse_args(argv)
    if not args.text_field:
        raise UserError("--text-field: must name a field, got ''")
    check_output_path(args.out, "--out", ".json")
    files = corpus_files(args.data)
    t0 = time.perf_counter()
    tok, stats = train(files, args.vocab_size, args.text_field)
    atomic_write_bytes(args.out, tok.to_str().encode())  # type: ignore[attr-defined]
    vocab = tok.get_vocab_size(with_added_tokens=True)  # type: ignore[attr-defined]
    print(f"wrote {args.out}: byte-level BPE, vocab {vocab}, trained on {stats.documents} "
          f"document(s) of {len(files)} file(s) in {time.perf_counter() - t0:.1f} s")
    return 0


def entry() -> None:
    """Console entry point: run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
