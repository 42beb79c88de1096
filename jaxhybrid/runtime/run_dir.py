"""The run directory: the config a run wrote (``config.yaml``), and the checks a new run or a resume makes on
it before anything is built, once in ``jaxhybrid launch`` for all ranks and again in each trainer: the folder
takes files, holds no earlier run's checkpoints unless resuming, and a resume continues the same layout,
data order and data (:mod:`jaxhybrid.runtime.checkpoint.store` reads and writes the checkpoints themselves).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxhybrid.core.argtypes import check_writable
from jaxhybrid.core.config.parse import load_yaml
from jaxhybrid.core.config.schema import dump_config
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.model.transformer import PARAM_LAYOUT
from jaxhybrid.runtime.checkpoint.store import committed_steps, saved_meta
from jaxhybrid.runtime.config_load import config_from_dict
from jaxhybrid.runtime.data import Sampler
from jaxhybrid.runtime.data.splits import open_dataset
from jaxhybrid.runtime.metrics.tb_events import EVENTS_PREFIX


def saved_config(run_dir: str | Path):
    """The config a run in ``run_dir`` wrote (its ``config.yaml``), unchecked; None when there is none."""
    saved = Path(run_dir) / "config.yaml"
    return config_from_dict(load_yaml(saved), check=False) if saved.is_file() else None


def config_changes(old, new, keys=None) -> list[str]:
    """``"key: old -> new"`` for each dotted key (default: every field but ``run.resume`` and ``plan.file``,
    which ``config.yaml`` does not keep: the plan's values are compared one by one) that differs."""
    def get(c, key):
        sec, name = key.split(".")
        return getattr(getattr(c, sec), name)

    if keys is None:
        sections = [f.name for f in dataclasses.fields(new) if dataclasses.is_dataclass(getattr(new, f.name))]
        keys = [f"{sec}.{f.name}" for sec in sections for f in dataclasses.fields(getattr(new, sec))
                if (sec, f.name) not in (("run", "resume"), ("plan", "file"))]
    return [f"{k}: {get(old, k)} -> {get(new, k)}" for k in keys if get(old, k) != get(new, k)]


def unrecorded_settings(saved: Path, cfg) -> list[str]:
    """Settings that the earlier ``config.yaml`` (a full dump) does not hold: it was written by a version
    before they existed, whose behaviour its steps ran by (before optim.weight_decay_mask, every parameter
    decayed). Loading fills in today's defaults, so :func:`config_changes` cannot see them; a resume names
    them instead of changing the training without a word."""

    tree = load_yaml(saved) or {}
    out = []
    for sec in (f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))):
        held = tree.get(sec) or {}
        out += [f"{sec}.{f.name}: not in the earlier config.yaml (written before it existed) -> "
                f"{getattr(getattr(cfg, sec), f.name)}" for f in dataclasses.fields(getattr(cfg, sec))
                if f.name not in held and (sec, f.name) != ("run", "resume")]
    return out


def write_run_config(run_dir: Path, cfg, step: int) -> None:
    """``config.yaml``: the config this run trains with, ``run.resume`` false so that the file starts a run
    as it is (``--config run/config.yaml`` with another run.dir). A resume that changed settings (those a
    checkpoint allows: schedule, steps, evaluation, ...) says which, and keeps the file it replaces as
    ``config.step<N>.yaml``: what steps 1-N trained with."""
    import sys

    saved = run_dir / "config.yaml"
    old = saved_config(run_dir) if cfg.run.resume else None
    changes = config_changes(old, cfg) + unrecorded_settings(saved, cfg) if old is not None else []
    if changes:
        saved.replace(run_dir / f"config.step{step}.yaml")
        print(f"jaxhybrid: resuming at step {step} with changed settings: {'; '.join(changes)} (the earlier "
              f"config is kept as config.step{step}.yaml)", file=sys.stderr, flush=True)
    tmp = saved.with_name(".config.yaml.tmp")  # replaced whole: a crash leaves the old file or the new one
    # The values a plan file set are in the dump already; naming the file as well would apply it again over
    # them, so an edit of this file (pipeline.microbatches, ...) would be undone, and the file would need the
    # plan (as it is now) to train at all. A comment keeps where the layout came from.
    fresh = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=False),
                                plan=dataclasses.replace(cfg.plan, file=""))
    head = f"# layout from plan file {cfg.plan.file} (its values below; plan.file cleared)\n" if cfg.plan.file else ""
    tmp.write_text(head + dump_config(fresh))
    tmp.replace(saved)


def check_resume_layout(run_dir: str | Path, cfg) -> None:
    """Before a resume: the settings that shape the checkpointed state (model, parallel layout, offloaded
    optimizer buckets) must equal those of the run that wrote ``run_dir`` (its ``config.yaml``); else a
    ConfigError listing each change, instead of orbax's tree-structure mismatch at restore."""

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


def _newest_meta(run_dir: str | Path) -> dict | None:
    """The ``meta`` of the first rank's newest committed checkpoint; None when there is none or it cannot
    be read here (the restore then names the problem)."""
    steps = committed_steps(run_dir)
    if not steps:
        return None
    rank, held = next(iter(steps.items()))
    return saved_meta(run_dir, rank, held[-1])


def check_resume_data(run_dir: str | Path, cfg) -> None:
    """Before a resume from a prepared dataset (``data.path``): the newest checkpoint's sampler state
    against this run's train split (its length and a fingerprint of its tokens), so that other data, even
    of the same length, is named before the ranks start instead of after each built its model (or, of the
    same length, never). The built-in corpus is one fixed text, whose train split data.tokenizer and
    data.val_fraction shape: compared with the earlier config.yaml, as is leaving a data.path for it
    (preparing the corpus here to count its tokens would do each rank's first-use work in the launcher)."""

    if not cfg.data.path:
        old = saved_config(run_dir)
        changed = config_changes(old, cfg, ["data.path", "data.tokenizer", "data.val_fraction"]) if old else []
        if changed:
            raise ConfigError(f"--resume in {run_dir}: its checkpoints trained on other data than this run's built-in "
                              f"corpus ({'; '.join(changed)}); resume with the settings of {Path(run_dir) / 'config.yaml'}, "
                              f"or start a new run from its weights (jaxhybrid export, then --set train.init_from=...)")
        return
    state = (_newest_meta(run_dir) or {}).get("sampler")
    if not isinstance(state, dict):
        return  # unreadable here: the restore names it

    bad = Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed).mismatches(state)
    if bad:
        raise ConfigError(f"--resume in {run_dir}: its checkpoints trained on other data than data.path="
                          f"{cfg.data.path} ({'; '.join(bad)}); resume with the data that wrote them, or start a "
                          f"new run from its weights (jaxhybrid export, then --set train.init_from=...)")


def check_param_layout(run_dir: str | Path) -> None:
    """Before a resume or an export: the newest checkpoint holds this version's parameter layout
    (:data:`jaxhybrid.model.transformer.PARAM_LAYOUT`, in its meta; absent: layout 1, the fused qkv's
    columns as ``[q | k | v]``); else a ConfigError, since the weights would load and mean something else."""

    meta = _newest_meta(run_dir)
    got = meta.get("param_layout", 1) if isinstance(meta, dict) else PARAM_LAYOUT  # unreadable: restore names it
    if got != PARAM_LAYOUT:
        raise ConfigError(f"{run_dir}: its checkpoints hold parameter layout {got} (fused qkv columns as [q | k | v]), "
                          f"this jaxhybrid reads layout {PARAM_LAYOUT} (grouped [q_g | k_g | v_g] per key/value head, "
                          f"jaxhybrid/model/transformer.py); resume or export it with the version that wrote it, or "
                          f"start a new run")


def earlier_records(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` that a new one would replace or mix with: its metrics.jsonl
    (with the lines it holds) and its TensorBoard event files."""
    out = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        with open(metrics, "rb") as f:
            out.append(f"metrics.jsonl of {sum(1 for _ in f)} steps")
    events = sorted((run_dir / "tensorboard").glob(EVENTS_PREFIX + "*"))
    if events:
        out.append(f"{len(events)} TensorBoard event file{'s' if len(events) > 1 else ''}")
    return out


def check_run_dir(cfg) -> None:
    """``run.dir`` can take this run: its nearest existing folder takes a new file (probed: as root,
    ``os.access`` says yes even on /proc; unprobed, the first sign was orbax failing to make the folder
    after the model was initialised), and it holds no earlier run's checkpoints unless resuming, when
    they must have this run's layout. Needs no peer: the trainer checks it, and ``jaxhybrid launch`` once for all its ranks."""

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
    earlier = [] if cfg.run.resume or cfg.run.overwrite else earlier_records(run_dir)  # reads metrics.jsonl whole
    if earlier:
        raise ConfigError(f"run.dir={cfg.run.dir} holds the records of an earlier run ({', '.join(earlier)}) but no "
                          f"checkpoint to resume; train into another run.dir, or replace them with --set "
                          f"run.overwrite=true")
    if cfg.run.resume:
        if not committed_steps(run_dir):  # else every rank would start, build its model, then fail alike
            start = (f" (it starts from train.init_from={cfg.train.init_from}, which a resume ignores)"
                     if cfg.train.init_from else "")
            raise ConfigError(f"--resume (run.resume=true): run.dir={cfg.run.dir} holds no checkpoint to continue "
                              f"(no {run_dir / 'checkpoints'}/rank_*/<step>); start a new run without --resume{start}")
        check_resume_layout(run_dir, cfg)
        check_param_layout(run_dir)
        check_resume_data(run_dir, cfg)
