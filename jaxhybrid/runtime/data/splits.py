"""The run's token splits from a config: the training set and the fixed validation batches.

``data.path`` (a ``prepare-data`` directory) or, when empty, the built-in corpus prepared once into the
cache (``$JAXHYBRID_CACHE``, default ``~/.cache/jaxhybrid``). Importing this module does not import JAX.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxhybrid.core.config.schema import DataConfig
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime.data.dataset import Sampler, TokenDataset
from jaxhybrid.runtime.data.prepare import ensure_builtin_data
from jaxhybrid.runtime.data.tokenizer import BYTE_VOCAB


def cache_dir() -> Path:
    return Path(os.environ.get("JAXHYBRID_CACHE", Path.home() / ".cache" / "jaxhybrid"))


def open_dataset(cfg, split: str = "train"):
    """A split (train or val) of the token dataset: ``data.path`` if given, else the built-in corpus
    prepared once into the cache."""
    check_builtin_vocab(cfg)
    path = cfg.data.path or ensure_builtin_data(
        cache_dir() / "builtin", cfg.data.tokenizer, val_fraction=cfg.data.val_fraction,
        vocab_size=cfg.model.vocab_size if cfg.data.tokenizer == "bpe" else None)
    ds = TokenDataset(path, split=split)
    ds.check_vocab(cfg.model.vocab_size)
    ds.check_ids(cfg.model.vocab_size)
    if cfg.data.path:
        check_prepared_settings(cfg, ds)
    return ds


def check_builtin_vocab(cfg) -> None:
    """The built-in corpus's ids fit ``model.vocab_size``: 256 byte symbols, or a BPE of ``model.vocab_size``
    tokens, which holds them too. Known from the config alone, so ``jaxhybrid launch`` says it before mpiexec
    (:func:`check_data`); the ranks found it while preparing the corpus, each printing it (a BPE's in
    ``prepare-data``'s ``--vocab-size`` terms). A ``data.path``'s vocabulary is its meta's
    (:meth:`TokenDataset.check_vocab`)."""

    vocab = cfg.model.vocab_size
    if cfg.data.path or vocab >= BYTE_VOCAB:
        return
    if cfg.data.tokenizer == "bpe":
        raise ConfigError(f"data.tokenizer=bpe trains a BPE of model.vocab_size={vocab} tokens on the built-in "
                          f"corpus, and a byte-level BPE holds at least the {BYTE_VOCAB} byte symbols; set "
                          f"model.vocab_size >= {BYTE_VOCAB}")
    raise ConfigError(f"model.vocab_size={vocab} is smaller than the built-in corpus's {BYTE_VOCAB} byte symbols "
                      f"(data.tokenizer={cfg.data.tokenizer}); set model.vocab_size >= {BYTE_VOCAB}")


def check_prepared_settings(cfg, ds: TokenDataset) -> None:
    """``data.val_fraction`` and ``data.tokenizer`` shape the built-in corpus only: a prepared dataset's
    split and ids were fixed by ``prepare-data --val-fraction/--tokenizer``, which its meta records. A value
    that differs from the data's would evaluate on another split, or claim another tokenizer, than the
    run uses, with nothing said: refuse it. A default passes (a value left out cannot be told from one
    typed equal to it)."""

    asked, held = cfg.data.val_fraction, ds.meta.get("val_fraction")
    if held is not None and asked not in (DataConfig.val_fraction, held):
        raise ConfigError(f"data.val_fraction={asked} has no effect: data.path={cfg.data.path} was prepared with "
                          f"val_fraction {held} ({ds.meta['splits']['val']} val tokens), which fixed its split; "
                          f"leave data.val_fraction out or set it to {held}, or prepare the data again with "
                          f"--val-fraction {asked}")
    asked, held = cfg.data.tokenizer, ds.meta.get("tokenizer")
    if held is not None and asked not in (DataConfig.tokenizer, held):
        raise ConfigError(f"data.tokenizer={asked} has no effect: data.path={cfg.data.path} holds {held} token ids "
                          f"(prepare-data fixed them); leave data.tokenizer out or set it to {held}, or prepare the "
                          f"data again with --tokenizer {asked}")


def check_data(cfg) -> None:
    """The built-in corpus's ids fit the model (:func:`check_builtin_vocab`), or a given ``data.path`` holds
    the splits this run reads (a train split of at least one sequence), with ids the model can embed and, with
    ``train.eval_every``, a val split long enough: what every rank's trainer meets first. Cheap (memmaps),
    so ``jaxhybrid launch`` checks it once for all ranks. The built-in corpus itself is left to the ranks:
    they prepare it on first use, under a lock."""
    check_builtin_vocab(cfg)
    if cfg.data.path:
        # The train split must hold one window of data.seq_len + 1 tokens: the sampler says so, as the
        # trainer's own sampler would on every rank.
        Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
        if cfg.train.eval_every:
            validation_batches(cfg)


def validation_batches(cfg) -> list[np.ndarray]:
    """The ``train.eval_batches`` global batches every evaluation scores: fixed windows of the val split
    (the sampler's first steps), so successive validation losses compare the same tokens."""
    ds = open_dataset(cfg, "val")
    if len(ds) <= cfg.data.seq_len:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} needs a validation split, but the val split of "
                          f"{ds.dir} has {len(ds)} tokens (one sequence is data.seq_len + 1 = {cfg.data.seq_len + 1}): "
                          f"prepare the data with a larger val_fraction, or set train.eval_every=0")
    sampler = Sampler(ds, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
    return [sampler.batch(i) for i in range(cfg.train.eval_batches)]


def repetition_notes(cfg) -> list[str]:
    """What a run would read more than once within one batch, one run or one evaluation, which training
    gives no sign of (the loss just looks good): a train split with fewer windows of ``data.seq_len + 1``
    tokens than ``train.global_batch``, or than the run's steps read (several epochs), and
    ``train.eval_batches`` asking for more sequences than the val split has windows (the sampler wraps
    around; the loss is no better measured, the evaluation only longer)."""
    notes = []
    train = Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
    if train.n_windows < cfg.train.global_batch:
        notes.append(f"the train split of {train.dataset.dir} holds {len(train.dataset)} tokens, "
                     f"{train.n_windows} windows of data.seq_len + 1 = {cfg.data.seq_len + 1}: fewer than "
                     f"train.global_batch={cfg.train.global_batch}, so every batch repeats windows")
    elif cfg.train.steps * cfg.train.global_batch > train.n_windows:  # several epochs: fine, but say so
        read = cfg.train.steps * cfg.train.global_batch
        notes.append(f"train.steps={cfg.train.steps} x train.global_batch={cfg.train.global_batch} = {read} "
                     f"sequences: {read / train.n_windows:.1f} passes over the {train.n_windows} windows of the "
                     f"train split (each window is read more than once)")
    if cfg.train.eval_every:
        val = Sampler(open_dataset(cfg, "val"), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
        asked = cfg.train.eval_batches * cfg.train.global_batch
        if asked > val.n_windows:
            enough = -(-val.n_windows // cfg.train.global_batch)
            fix = f"eval_batches={enough} reads them all" if cfg.train.eval_batches > enough else \
                "fewer than one batch: prepare the data with a larger val_fraction"
            notes.append(f"train.eval_batches={cfg.train.eval_batches} x train.global_batch="
                         f"{cfg.train.global_batch} = {asked} sequences, but the val split holds {val.n_windows} "
                         f"windows: each evaluation repeats them ({fix})")
    return notes
