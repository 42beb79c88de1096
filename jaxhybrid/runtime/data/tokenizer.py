"""Tokenizers for ``prepare-data``: raw UTF-8 bytes, or a byte-level BPE trained offline.

Both share one small interface: ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``name``, plus ``encode_array`` (a NumPy fast path used on whole corpora). The BPE is byte-level
(GPT-2 style pre-tokenizer over the 256 byte symbols), so every string round-trips exactly and no
unknown token exists. It is trained with HF ``tokenizers`` from the text itself: nothing is downloaded
(tiktoken fetches its encodings at run time, which fails offline).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np

TOKENIZERS = ("byte", "bpe")
BYTE_VOCAB = 256  # the byte tokenizer's vocabulary, and the least a byte-level BPE holds
_CHUNK_LINES = 4096  # lines per encode_batch call: bounded memory, parallel inside the Rust encoder


class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_array(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, no training, lossless."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        # A window cut from the middle of a multi-byte character decodes with U+FFFD, not an error.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"type": "byte"}))


class BPETokenizer:
    """A byte-level BPE (HF ``tokenizers``); see :func:`train_bpe`."""

    name = "bpe"

    def __init__(self, tok):
        self._tok = tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_array(self, text: str) -> np.ndarray:
        # Encoding line by line (each keeps its newline) is exact: the concatenation decodes to ``text``.
        lines = text.splitlines(keepends=True)
        parts = []
        for i in range(0, len(lines), _CHUNK_LINES):
            for enc in self._tok.encode_batch(lines[i:i + _CHUNK_LINES]):
                parts.append(np.asarray(enc.ids, dtype=np.uint32))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))


def train_bpe(text: str | Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE on ``text`` (a string or an iterable of strings).

    Args:
      text: training text.
      vocab_size: total vocabulary, including the 256 byte symbols; must be in [256, 2**32).

    Returns:
      A :class:`BPETokenizer` whose ``vocab_size`` is at most ``vocab_size`` (fewer when the text has
      fewer distinct merges).
    """
    if not 256 <= vocab_size < 2**32:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least the 256 byte symbols; "
                         f"use --vocab-size >= 256")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    lines = text.splitlines(keepends=True) if isinstance(text, str) else text
    tok.train_from_iterator(lines, trainer)
    return BPETokenizer(tok)


def make_tokenizer(name: str, text: str, vocab_size: int | None) -> Tokenizer:
    """``byte`` (``vocab_size`` must be None or 256) or a BPE trained on ``text``."""
    if name == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"--vocab-size {vocab_size} does not apply to the byte tokenizer (always 256); "
                             f"drop it or use --tokenizer bpe")
        return ByteTokenizer()
    if name == "bpe":
        if vocab_size is None:
            raise ValueError("the bpe tokenizer needs a vocabulary size (--vocab-size N, N >= 256)")
        return train_bpe(text, vocab_size)
    raise ValueError(f"tokenizer {name!r} is unknown; choose one of {', '.join(TOKENIZERS)}")


def load_tokenizer(name: str, path: str | Path | None = None) -> Tokenizer:
    """The tokenizer a prepared dataset was made with (``path``: its saved tokenizer file, for BPE)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        if path is None or not Path(path).is_file():
            raise FileNotFoundError(f"BPE tokenizer file not found: {path}")
        return BPETokenizer.load(path)
    raise ValueError(f"tokenizer {name!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
