"""Atomic, per-rank checkpoints with orbax; resume restores params, optimizer, loss scale and sampler.

Layout: ``<run.dir>/checkpoints/rank_<r>/<step>/`` written by an orbax ``CheckpointManager`` (it writes
to a temporary directory and renames it on commit, so a crash mid-save leaves nothing that loads).
Under mpirun each rank is its own single-process JAX (facts.md), so each rank owns its directory; the
step to resume from is the newest one that *every* rank committed, agreed through the engine.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def spans_processes(x) -> bool:
    """A jax.Array spanning devices of other processes (``--distributed``): no process can fetch it whole,
    so orbax writes each process's shards of it into the one checkpoint."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _to_host(tree):
    return jax.tree.map(lambda x: x if spans_processes(x) else np.asarray(x), tree)


def _abstract(x):
    """The restore target of one leaf: global arrays (across processes, or over a one-process mesh) come back
    with their live sharding, the rest as numpy. Why the one-process mesh too: a checkpoint that
    ``--distributed`` processes wrote records its arrays' shardings, and orbax refuses to restore those
    without a sharded target ("Topology mismatch"), so one process could not resume it on the same mesh."""
    if isinstance(x, jax.ShapeDtypeStruct):  # already a target
        return x
    if spans_processes(x) or (isinstance(x, jax.Array) and len(x.sharding.device_set) > 1):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return np.zeros((), x.dtype) if x.ndim == 0 else jax.ShapeDtypeStruct(x.shape, x.dtype)


def state_metadata(path: str | Path) -> Any:
    """The tree of shapes and dtypes of one saved ``state`` (``<rank dir>/<step>/state``), no array loaded."""
    # orbax looks for the step's metadata file in the item's own folder and logs a warning per read.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        meta = ocp.StandardCheckpointer().metadata(Path(path).absolute())
    except FileNotFoundError:
        meta = None
    finally:
        absl.setLevel(level)
    meta = getattr(meta, "item_metadata", meta)
    if meta is None:  # orbax returns None when the folder lacks its metadata file (a damaged or copied-in-part save)
        raise ValueError(f"{path} holds no readable checkpoint (its orbax metadata is missing); restore the "
                         f"folder from a copy, or use another step")
    return meta


def read_state(path: str | Path) -> Any:
    """One saved ``state`` (``<rank dir>/<step>/state``) as numpy, in this process, whatever mesh and
    process count wrote it (tools, tests, export). orbax alone refuses a checkpoint of global arrays written
    on another topology without a target, so the target is built from its metadata, on one device."""
    reader = ocp.StandardCheckpointer()
    tree = state_metadata(path)
    # This process's device: under --distributed jax.devices()[0] is process 0's, which another process
    # cannot fill ("no addressable shards"), and the restore's collective barrier then hangs process 0.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
    return jax.tree.map(np.asarray, reader.restore(Path(path).absolute(), target))


def committed_steps(run_dir: str | Path) -> dict[str, list[int]]:
    """The steps checkpointed in each rank's folder of ``run_dir`` (from the folder names; orbax names a
    step's folder by its number once committed, and an unfinished save by a temporary name)."""
    out = {}
    for d in sorted((Path(run_dir) / "checkpoints").glob("rank_*")):
        steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())
        if steps:
            out[d.name] = steps
    return out


def saved_config(run_dir: str | Path):
    """The config a run in ``run_dir`` wrote (its ``config.yaml``), unchecked; None when there is none."""
    from jaxhybrid.config import config_from_dict, load_yaml

    saved = Path(run_dir) / "config.yaml"
    return config_from_dict(load_yaml(saved), check=False) if saved.is_file() else None


def config_changes(old, new, keys=None) -> list[str]:
    """``"key: old -> new"`` for each dotted key (default: every field but ``run.resume``) that differs."""
    def get(c, key):
        sec, name = key.split(".")
        return getattr(getattr(c, sec), name)

    if keys is None:
        sections = [f.name for f in dataclasses.fields(new) if dataclasses.is_dataclass(getattr(new, f.name))]
        keys = [f"{sec}.{f.name}" for sec in sections for f in dataclasses.fields(getattr(new, sec))
                if (sec, f.name) != ("run", "resume")]
    return [f"{k}: {get(old, k)} -> {get(new, k)}" for k in keys if get(old, k) != get(new, k)]


def write_run_config(run_dir: Path, cfg, step: int) -> None:
    """``config.yaml``: the config this run trains with, ``run.resume`` false so that the file starts a run
    as it is (``--config run/config.yaml`` with another run.dir). A resume that changed settings (those a
    checkpoint allows: schedule, steps, evaluation, ...) says which, and keeps the file it replaces as
    ``config.step<N>.yaml``: what steps 1-N trained with."""
    import sys

    from jaxhybrid.config import dump_config

    saved = run_dir / "config.yaml"
    old = saved_config(run_dir) if cfg.run.resume else None
    changes = config_changes(old, cfg) if old is not None else []
    if changes:
        saved.replace(run_dir / f"config.step{step}.yaml")
        print(f"jaxhybrid: resuming at step {step} with changed settings: {'; '.join(changes)} (the earlier "
              f"config is kept as config.step{step}.yaml)", file=sys.stderr, flush=True)
    tmp = saved.with_name(".config.yaml.tmp")  # replaced whole: a crash leaves the old file or the new one
    tmp.write_text(dump_config(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=False))))
    tmp.replace(saved)


def check_resume_layout(run_dir: str | Path, cfg) -> None:
    """Before a resume: the settings that shape the checkpointed state (model, parallel layout, offloaded
    optimizer buckets) must equal those of the run that wrote ``run_dir`` (its ``config.yaml``); else a
    ConfigError listing each change, instead of orbax's tree-structure mismatch at restore."""
    from jaxhybrid.config import ConfigError

    old = saved_config(run_dir)
    if old is None:
        return
    saved = Path(run_dir) / "config.yaml"
    keys = [f"{sec}.{f.name}" for sec in ("model", "parallel") for f in dataclasses.fields(getattr(cfg, sec))]
    keys += ["optim.offload"] + (["optim.bucket_size"] if cfg.optim.offload else [])
    changed = config_changes(old, cfg, keys)
    if changed:
        raise ConfigError(f"--resume in {run_dir}: its checkpoints were written with another layout "
                          f"({'; '.join(changed)}); resume with the settings of {saved}, or train into another run.dir")
    # The saved sampler position only means something for the same data order (data.Sampler.load_state_dict
    # would refuse it too, but only once every rank has started and built its model).
    changed = config_changes(old, cfg, ["train.seed", "train.global_batch", "data.seq_len"])
    if changed:
        raise ConfigError(f"--resume in {run_dir}: its checkpoints continue another data order "
                          f"({'; '.join(changed)}); resume with the settings of {saved}, or start a new run from "
                          f"its weights (jaxhybrid export, then --set train.init_from=...)")


def check_resume_data(run_dir: str | Path, cfg) -> None:
    """Before a resume from a prepared dataset (``data.path``): the newest checkpoint's sampler state
    against this run's train split (its length and a fingerprint of its tokens), so that other data, even
    of the same length, is named before the ranks start instead of after each built its model (or, of the
    same length, never). The built-in corpus is one fixed text."""
    import json

    from jaxhybrid.config import ConfigError

    steps = committed_steps(run_dir)
    if not cfg.data.path or not steps:
        return
    rank, held = next(iter(steps.items()))
    meta = Path(run_dir) / "checkpoints" / rank / str(held[-1]) / "meta" / "metadata"
    try:
        state = json.loads(meta.read_text())["sampler"]
    except (OSError, ValueError, KeyError):
        return  # unreadable here: the restore names it
    from jaxhybrid.data import Sampler
    from jaxhybrid.data.splits import open_dataset

    bad = Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed).mismatches(state)
    if bad:
        raise ConfigError(f"--resume in {run_dir}: its checkpoints trained on other data than data.path="
                          f"{cfg.data.path} ({'; '.join(bad)}); resume with the data that wrote them, or start a "
                          f"new run from its weights (jaxhybrid export, then --set train.init_from=...)")


class Checkpointer:
    """Saves ``{"state": pytree, "meta": json}`` per step for this rank."""

    def __init__(self, run_dir: str | Path, rank: int = 0, keep: int = 2):
        self.dir = Path(run_dir).absolute() / "checkpoints" / f"rank_{rank}"
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                            enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.dir, options=opts)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def save(self, step: int, state: Any, meta: dict) -> None:
        # Host copies: offloaded optimizer state is numpy already; device arrays are fetched once here, except
        # those spanning other processes, which orbax writes shard by shard from every process.
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_to_host(state)),
                                                         meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def discard_after(self, step: int) -> list[int]:
        """Delete this rank's checkpoints newer than ``step`` (the newest one every rank has), returning
        their steps. Why: a job that died mid-save leaves some ranks a step ahead; kept, that step would
        stay the old run's on those ranks (orbax does not save a step it holds) while the others write the
        resumed run's, and a later resume would load one checkpoint made of two trajectories."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.manager.delete(s)
        return newer

    def state_metadata(self, step: int) -> Any:
        """The saved state's tree of shapes and dtypes at ``step`` (nothing loaded)."""
        return state_metadata(self.dir / str(step) / "state")

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore ``step`` into arrays shaped like ``like`` (numpy, bit-identical; leaves spanning other
        processes come back as global arrays sharded like ``like``'s)."""
        abstract = jax.tree.map(_abstract, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                  meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> None:
        self.manager.close()


def check_run_dir(cfg) -> None:
    """``run.dir`` can take this run: its nearest existing folder takes a new file (probed: as root,
    ``os.access`` says yes even on /proc; unprobed, the first sign was orbax failing to make the folder
    after the model was initialised), and it holds no earlier run's checkpoints unless resuming, when
    they must have this run's layout. Needs no peer: the trainer checks it, and ``jaxhybrid launch`` once for all its ranks."""
    from jaxhybrid.commands.argtypes import check_writable
    from jaxhybrid.config import ConfigError

    run_dir = Path(cfg.run.dir)
    try:
        check_writable(run_dir, "run.dir=", directory=True, hint="; pick another --set run.dir=...")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    found = {} if cfg.run.resume else committed_steps(run_dir)
    if found:
        # orbax skips saving a step at or below the newest one present, so a new run here would keep
        # the old checkpoints and save none of its own (and a later --resume would load the old ones).
        held = "; ".join(f"{r}: steps {', '.join(map(str, s))}" for r, s in list(found.items())[:2])
        raise ConfigError(f"run.dir={cfg.run.dir} holds checkpoints of an earlier run ({held}"
                          f"{'; ...' if len(found) > 2 else ''}); continue it with --resume (run.resume=true), "
                          f"train into another run.dir, or delete {run_dir / 'checkpoints'}")
    if cfg.run.resume:
        if not committed_steps(run_dir):  # else every rank would start, build its model, then fail alike
            start = (f" (it starts from train.init_from={cfg.train.init_from}, which a resume ignores)"
                     if cfg.train.init_from else "")
            raise ConfigError(f"--resume (run.resume=true): run.dir={cfg.run.dir} holds no checkpoint to continue "
                              f"(no {run_dir / 'checkpoints'}/rank_*/<step>); start a new run without --resume{start}")
        check_resume_layout(run_dir, cfg)
        check_resume_data(run_dir, cfg)
