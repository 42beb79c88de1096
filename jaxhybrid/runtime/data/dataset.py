"""A prepared token memmap and the deterministic, resumable sampler that cuts global batches from it.

The sampler is stateless in the way that matters: ``batch(step)`` is a pure function of
``(seed, step)`` and the data, so resuming needs only the step, and every rank of a parallel job
builds the identical global batch (the engine then slices its replica and microbatches with
:func:`jaxhybrid.runtime.engines.base.split_batch`, so tokens per step do not depend on the layout).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime.data.prepare import FORMAT_VERSION, META, TOKENIZER_FILE
from jaxhybrid.runtime.data.tokenizer import Tokenizer, load_tokenizer

SPLITS = ("train", "val")
SCAN_CHUNK = 1 << 24  # tokens per read of a scan: 32 MiB of uint16, a bounded slice of the memmap in memory
_SCANNED: dict[tuple, int | None] = {}  # (bin path, size, mtime) -> its largest id: one scan per process


def _resolve_dir(path: str | Path) -> Path:
    """``path`` may be the prepared directory or any file in it (``train.bin``, ``meta.json``)."""
    p = Path(path)
    if p.is_dir():
        return p
    if p.is_file() and p.name not in (META, TOKENIZER_FILE) and p.suffix != ".bin":  # raw text, most likely
        raise FileNotFoundError(f"data path {p} is a file, not a prepared dataset; tokenize it first: "
                                f"`jaxhybrid prepare-data --out DIR --input {p}`, then data.path=DIR")
    if p.is_file() or p.name in (META, TOKENIZER_FILE) or p.suffix == ".bin":
        if p.parent.is_dir():
            return p.parent
    raise FileNotFoundError(f"data path not found: {p}; create it with `jaxhybrid prepare-data --out DIR`")


class TokenDataset:
    """One split of a directory written by :func:`~jaxhybrid.runtime.data.prepare.prepare_data`, memory-mapped.

    Attributes:
      tokens: read-only 1-D ``np.memmap`` of token ids (uint8, uint16 or uint32, as ``meta.json`` says).
      vocab_size: the tokenizer's vocabulary (ids are below it).
      meta: the directory's ``meta.json``.
    """

    def __init__(self, path: str | Path, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; choose one of {', '.join(SPLITS)}")
        self.dir = _resolve_dir(path)
        self.split = split
        meta_path = self.dir / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: {self.dir} is not a prepared dataset (or its "
                                    f"preparation was interrupted); run `jaxhybrid prepare-data --out {self.dir}`")
        try:
            self.meta: dict[str, Any] = json.loads(meta_path.read_text())
            dtype = np.dtype(self.meta["dtype"])
            count = int(self.meta["splits"][split])
            self.vocab_size = int(self.meta["vocab_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path} is malformed ({e}); prepare the data again") from None
        if self.meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{meta_path} has format {self.meta.get('format')}, this version reads "
                             f"{FORMAT_VERSION}; prepare the data again")
        bin_path = self.dir / f"{split}.bin"
        if not bin_path.is_file():
            raise FileNotFoundError(f"token file not found: {bin_path}")
        size = bin_path.stat().st_size
        if size != count * dtype.itemsize:
            raise ValueError(f"{bin_path} has {size} bytes but meta.json records {count} {dtype.name} tokens "
                             f"({count * dtype.itemsize} bytes); prepare the data again")
        # np.memmap cannot map an empty file; an empty split (val_fraction=0) is a plain empty array.
        self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def fingerprint(self) -> str:
        """A digest of the split's length, first and last 256 Ki tokens: cheap on a memmap of any size,
        and what a resume compares to tell the data it trained on from other data of the same length."""
        import hashlib

        n, edge = len(self), 1 << 18
        # uint8 ids hash as uint16: byte data was stored as uint16 before, and the same tokens must keep the
        # fingerprint its checkpoints hold, or a resume after preparing the data again would be refused.
        wide = np.dtype(np.uint16) if self.tokens.dtype.itemsize < 2 else self.tokens.dtype
        h = hashlib.sha1(f"{n}:{wide.name}".encode())
        h.update(np.ascontiguousarray(self.tokens[:edge], dtype=wide).tobytes())
        h.update(np.ascontiguousarray(self.tokens[max(edge, n - edge):], dtype=wide).tobytes())
        return h.hexdigest()[:16]

    def check_vocab(self, model_vocab: int) -> None:
        """Raise if a model with ``model_vocab`` embeddings cannot index every token id of this data."""
        if model_vocab < self.vocab_size:
            raise ValueError(f"model.vocab_size={model_vocab} is smaller than the data's vocabulary "
                             f"{self.vocab_size} ({self.meta['tokenizer']} tokenizer, {self.dir}); set "
                             f"model.vocab_size >= {self.vocab_size} or prepare the data with a smaller vocabulary")

    def max_id(self) -> int | None:
        """The largest token id of this split (None: empty): as ``meta.json`` records it (``prepare-data``
        writes ``max_id``), else scanned once per process, in chunks, with a progress bar past one chunk."""
        recorded = self.meta.get("max_id")
        if isinstance(recorded, dict) and self.split in recorded:
            return recorded[self.split]
        path = self.dir / f"{self.split}.bin"
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _SCANNED:
            n, top = len(self), None
            chunks = range(0, n, SCAN_CHUNK)
            for i in tqdm(chunks, desc=f"jaxhybrid: largest token id in {path}", unit="chunk",
                          disable=len(chunks) <= 1, leave=False):
                m = int(self.tokens[i:i + SCAN_CHUNK].max())
                top = m if top is None else max(top, m)
            _SCANNED[key] = top
        return _SCANNED[key]

    def check_ids(self, model_vocab: int) -> None:
        """Raise if this split holds a token id that a model with ``model_vocab`` embeddings cannot index (a
        file written outside ``prepare-data``, or with another vocabulary than its meta says)."""
        top = self.max_id()
        if top is not None and top >= model_vocab:
            raise ConfigError(f"{self.dir / (self.split + '.bin')} holds token id {top}, but model.vocab_size="
                             f"{model_vocab} embeds ids 0..{model_vocab - 1} (meta.json says vocab_size "
                             f"{self.vocab_size}); prepare the data again with its tokenizer, or set "
                             f"model.vocab_size > {top}")

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the data was prepared with (to decode samples)."""
        f = self.meta.get("tokenizer_file")
        return load_tokenizer(self.meta["tokenizer"], self.dir / f if f else None)


class Sampler:
    """Global batches of ``seq_len + 1`` token windows, shuffled per epoch, pure in ``(seed, step)``.

    Windows start at ``offset_e + i * seq_len`` (consecutive windows share one token: the last target
    of one is the first input of the next), ``i`` in a permutation of ``range(n_windows)`` drawn,
    together with the epoch's offset ``offset_e`` in ``[0, seq_len)``, from
    ``Generator(PCG64(SeedSequence([seed, epoch])))``. Sample ``k = step * global_batch + row`` is
    window ``k mod n_windows`` of epoch ``k // n_windows``, so no window repeats within an epoch and
    the random offset makes later epochs see shifted windows.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch: int, seed: int):
        for name, v in (("seq_len", seq_len), ("global_batch", global_batch)):
            if int(v) < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if int(seed) < 0:
            raise ValueError(f"seed={seed} must be >= 0 (it keys numpy's SeedSequence)")
        self.dataset, self.seq_len, self.global_batch, self.seed = dataset, int(seq_len), int(global_batch), int(seed)
        n = len(dataset)
        nw = (n - 1) // self.seq_len
        if nw < 1:
            raise ValueError(f"the {dataset.split} split of {dataset.dir} has {n} tokens; one sequence needs "
                             f"data.seq_len + 1 = {self.seq_len + 1}: lower data.seq_len or give more text")
        if nw >= 2:
            nw -= 1  # keep one window of slack so every epoch can shift all windows by up to seq_len - 1
        self.n_windows = nw
        self.n_offsets = min(self.seq_len, n - 1 - nw * self.seq_len + 1)
        self.step = 0  # consumed steps, for next_batch() and state_dict()
        self._epochs: dict[int, tuple[np.ndarray, int]] = {}
        self._fingerprint: str | None = None  # of the dataset, computed at the first state_dict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, int]:
        if epoch not in self._epochs:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            perm = rng.permutation(self.n_windows)
            offset = int(rng.integers(0, self.n_offsets))
            if len(self._epochs) >= 4:  # a batch touches at most a few epochs; keep the cache small
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = (perm, offset)
        return self._epochs[epoch]

    def starts(self, step: int) -> np.ndarray:
        """Start offsets (into the token stream) of the ``global_batch`` windows of ``step``."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        k = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, pos = np.divmod(k, self.n_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            perm, offset = self._epoch(int(e))
            sel = epochs == e
            out[sel] = perm[pos[sel]] * self.seq_len + offset
        return out

    def batch(self, step: int) -> np.ndarray:
        """``int32 [global_batch, seq_len + 1]``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
        idx = self.starts(step)[:, None] + np.arange(self.seq_len + 1)
        return np.array(self.dataset.tokens[idx], dtype=np.int32)

    def next_batch(self) -> np.ndarray:
        """The batch at the consumed-step position, then advance it."""
        b = self.batch(self.step)
        self.step += 1
        return b

    def state_dict(self, step: int | None = None) -> dict[str, int]:
        """Position (``step``, default the consumed steps) plus what must match on resume."""
        if self._fingerprint is None:
            self._fingerprint = self.dataset.fingerprint()
        return {"step": int(self.step if step is None else step), "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_tokens": len(self.dataset), "n_windows": self.n_windows,
                "data_fingerprint": self._fingerprint}

    def mismatches(self, state: dict[str, Any]) -> list[str]:
        """What differs between this sampler and a saved ``state`` (checkpoints without a fingerprint,
        written before it was recorded, are compared without it)."""
        mine = self.state_dict()
        bad = [f"{k}: checkpoint {state.get(k)} != current {mine[k]}" for k in
               ("seed", "seq_len", "global_batch", "n_tokens") if k in state and int(state[k]) != mine[k]]
        if state.get("data_fingerprint", mine["data_fingerprint"]) != mine["data_fingerprint"]:
            bad.append(f"the train tokens differ (fingerprint {state['data_fingerprint']} != "
                       f"{mine['data_fingerprint']})")
        return bad

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; raise if it was saved for another seed, shape or dataset."""
        bad = self.mismatches(state)
        if bad:
            raise ValueError("the checkpoint's sampler does not match this run (" + "; ".join(bad) +
                             "): resume with the same train.seed, data.seq_len, train.global_batch and data")
        self.step = int(state["step"])
