"""Tokenize a corpus into the token cache ahead of a run (what every rank would do first).

    python scripts/prepare_data.py --data CORPUS [--tokenizer tokenizer.json] \
        [--text-field text] [--token-cache DIR]

Run it on each host (or once on a shared --token-cache folder) before a launch whose corpus
takes longer to tokenize than the ranks' rendezvous --timeout-s; the ranks then find the
cache and reuse it (same flags as dist_runner.py's data flags; modules/data/token_cache.py).
Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from formats.errors import run_main  # noqa: E402
from modules.config import DataConfig  # noqa: E402
from modules.data.corpus import corpus_files  # noqa: E402
from modules.data.token_cache import open_tokens  # noqa: E402
from modules.data.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, build (or find) the cache, say where it is."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help="comma-separated text/.jsonl/.parquet files, folders or quoted globs")
    p.add_argument("--tokenizer", default="bytes", help="`bytes` or a tokenizer.json")
    p.add_argument("--text-field", default="text",
                   help="text field of .jsonl records / column of .parquet files")
    p.add_argument("--token-cache", default=None,
                   help="cache folder (default ~/.cache/scattered-train/tokens)")
    args = p.parse_args(argv)
    DataConfig(data=args.data, tokenizer=args.tokenizer, text_field=args.text_field,
               token_cache=args.token_cache)  # the runner's checks of these flags
    tok = load_tokenizer(args.tokenizer)
    files = corpus_files(args.data)
    corpus = open_tokens(files, tok, args.text_field,
                         Path(args.token_cache) if args.token_cache else None)
    how = (f"tokenized in {corpus.built_s:.1f} s" if corpus.built_s is not None
           else "already there")
    print(f"{corpus.path}: {corpus.info['tokens']} tokens of {len(files)} file(s), "
          f"{corpus.info['documents']} document(s), {corpus.info['skipped']} skipped ({how})")
    return 0


def entry() -> None:
    """Console entry point: run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
