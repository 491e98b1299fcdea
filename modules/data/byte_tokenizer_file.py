"""A `tokenizer.json` that encodes like the runtime's byte tokenizer (token = byte, vocab 256),
so an export of a byte-tokenized run loads with `transformers.AutoTokenizer` and its ids are
the ones the model was trained on. Built locally with the `tokenizers` package (nothing is
downloaded).

The file is a BPE model without merges over a byte-level pre-tokenizer: the pre-tokenizer turns
each byte of the UTF-8 text into one printable stand-in character, and the vocabulary gives the
stand-in of byte b the id b.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


def _stand_ins() -> dict[int, str]:
    """Byte -> the character the byte-level pre-tokenizer writes for it: printable Latin-1
    bytes stand for themselves, the others (controls, space, ...) take code points from 256 on,
    in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer_json() -> str:
    """The tokenizer.json text (token id = byte value, no special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _stand_ins().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def write_byte_tokenizer(folder: Path) -> list[str]:
    """tokenizer.json and tokenizer_config.json in `folder`; returns their names."""
    (folder / TOKENIZER_NAME).write_text(byte_tokenizer_json())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
              "clean_up_tokenization_spaces": False}
    (folder / TOKENIZER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_NAME, TOKENIZER_CONFIG_NAME]


def is_byte_tokenizer(path: Path) -> bool:
    """Whether `path` is a tokenizer.json of this module's kind (token id = byte value), so a
    run started from an export of a byte-tokenized run reads bytes again, as it was trained."""
    try:
        if path.stat().st_size > 1 << 20:  # ours is ~10 kB; a real vocabulary is not ours
            return False
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        return False
    model, pre = obj["model"], obj.get("pre_tokenizer") or {}
    want = {char: b for b, char in _stand_ins().items()}
    return (model.get("type") == "BPE" and not model.get("merges")
            and model.get("vocab") == want and isinstance(pre, dict)
            and pre.get("type") == "ByteLevel" and not obj.get("normalizer")
            and not obj.get("added_tokens"))
