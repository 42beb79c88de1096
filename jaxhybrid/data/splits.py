"""The run's token splits from a config: the training set and the fixed validation batches.

``data.path`` (a ``prepare-data`` directory) or, when empty, the built-in corpus prepared once into the
cache (``$JAXHYBRID_CACHE``, default ``~/.cache/jaxhybrid``). Importing this module does not import JAX.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxhybrid.data.dataset import Sampler, TokenDataset
from jaxhybrid.data.prepare import ensure_builtin_data


def cache_dir() -> Path:
    return Path(os.environ.get("JAXHYBRID_CACHE", Path.home() / ".cache" / "jaxhybrid"))


def open_dataset(cfg, split: str = "train"):
    """A split (train or val) of the token dataset: ``data.path`` if given, else the built-in corpus
    prepared once into the cache."""
    path = cfg.data.path or ensure_builtin_data(
        cache_dir() / "builtin", cfg.data.tokenizer, val_fraction=cfg.data.val_fraction,
        vocab_size=cfg.model.vocab_size if cfg.data.tokenizer == "bpe" else None)
    ds = TokenDataset(path, split=split)
    ds.check_vocab(cfg.model.vocab_size)
    return ds


def check_data(cfg) -> None:
    """A given ``data.path`` holds the splits this run reads, with ids the model can embed and, with
    ``train.eval_every``, a val split long enough: what every rank's trainer meets first. Cheap (memmaps),
    so ``jaxhybrid launch`` checks it once for all ranks. The built-in corpus is left to the ranks: it is
    prepared on first use, under a lock."""
    if cfg.data.path:
        open_dataset(cfg)
        if cfg.train.eval_every:
            validation_batches(cfg)


def validation_batches(cfg) -> list[np.ndarray]:
    """The ``train.eval_batches`` global batches every evaluation scores: fixed windows of the val split
    (the sampler's first steps), so successive validation losses compare the same tokens."""
    ds = open_dataset(cfg, "val")
    if len(ds) <= cfg.data.seq_len:
        from jaxhybrid.config import ConfigError

        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs a validation split, but the val split of "
                          f"{ds.dir} has {len(ds)} tokens (one sequence is data.seq_len + 1 = {cfg.data.seq_len + 1}): "
                          f"prepare the data with a larger val_fraction, or set train.eval_every=0")
    sampler = Sampler(ds, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
    return [sampler.batch(i) for i in range(cfg.train.eval_batches)]
