"""Real text for training: tokenizers, ``prepare-data`` memmaps, and the deterministic sampler.

Modules: ``tokenizer`` (byte-level and offline-trained BPE), ``prepare`` (text -> ``train.bin`` /
``val.bin`` / ``meta.json``, the built-in KJV corpus), ``dataset`` (``TokenDataset`` memmap and the
resumable ``Sampler``), ``splits`` (a config's training set and fixed validation batches). Importing
this package does not import JAX.
"""
from jaxhybrid.runtime.data.dataset import Sampler, TokenDataset
from jaxhybrid.runtime.data.prepare import (
           DEFAULT_BPE_VOCAB,
           builtin_corpus_text,
           ensure_builtin_data,
           prepare_data,
           token_dtype,
)
from jaxhybrid.runtime.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, make_tokenizer, train_bpe

__all__ = ["BPETokenizer", "ByteTokenizer", "DEFAULT_BPE_VOCAB", "Sampler", "TokenDataset", "builtin_corpus_text",
           "ensure_builtin_data", "load_tokenizer", "make_tokenizer", "prepare_data", "token_dtype", "train_bpe"]
