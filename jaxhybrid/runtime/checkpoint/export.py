"""A run's weights as one single-device checkpoint, whatever layout trained them; a run started from one.

A run's checkpoints are per rank and shaped by its layout (``jaxhybrid.runtime.checkpoint.store``): a pipeline rank
holds its stage's parts (``embed``, ``block_<i>``, ``head``, and the tied head copy ``embed_wte_copy``),
data replicas hold copies, a tensor mesh writes global arrays, and with the offloaded optimizer (Myelin
V-B) the fp32 master weights are its host state (flat, in ``jax.tree.leaves`` order of the rank's params;
across processes a tree) while the saved params are the compute-precision copy. :func:`export_run` reads
every rank's state at one step and writes the model's own flat dict of fp32 master weights, what
``Model.init`` returns and ``Model.loss`` takes: the single-device reference's format. So a model trained
on a pipeline can be evaluated on one device (:func:`load_export`), and a run on any other layout can
start from it (``train.init_from``: :func:`params_for` slices it for a rank's live parameters).

Only the weights travel: a run started from an export has a fresh AdamW state at step 0 (fine-tuning,
or a new layout for the rest of a schedule). ``--resume`` keeps optimizer, loss scale and sampler, and so
needs the layout that wrote the checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxhybrid.core.config.model import shape_settings
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.model import Model
from jaxhybrid.model.transformer import PARAM_LAYOUT, TIED_KEY
from jaxhybrid.optim.updater import place_like
from jaxhybrid.parallel.data.flat import FlatSpec
from jaxhybrid.runtime.checkpoint.store import committed_steps, read_state, state_metadata
from jaxhybrid.runtime.run_dir import check_param_layout, saved_config

META = "export.json"
PARAMS = "params"


def master_params(state: dict, offload: bool) -> dict:
    """A rank's fp32 master weights from its saved ``state``: the params, or with the offloaded optimizer
    its ``master`` column, unflattened in the params' own leaf order."""
    params = state["params"]
    if not offload:
        return params
    master = state["opt_state"]["master"]
    if isinstance(master, np.ndarray) and master.ndim == 1:
        return FlatSpec(params).unravel_host(master)
    return master  # --distributed: a params-shaped tree of global arrays


def consolidate(run_dir: str | Path, step: int | None = None) -> tuple[dict, int, object]:
    """The model's flat dict of fp32 weights at ``step`` (default: the newest step every rank saved),
    gathered from all ranks of ``run_dir``, with the step and the run's config. Each part comes from the
    lowest rank holding it (data replicas hold the same values); the tied copy is ``embed.wte``'s."""

    run_dir = Path(run_dir)
    cfg = saved_config(run_dir)
    if cfg is None:
        raise ValueError(f"{run_dir} has no config.yaml: not the run.dir of a jaxhybrid run")
    steps = committed_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir} holds no committed checkpoint (checkpoints/rank_*/<step>); train with "
                         f"checkpoint.at_end=true or checkpoint.every=N")
    common = sorted(set.intersection(*(set(s) for s in steps.values())))
    if step is None and not common:
        raise ValueError(f"no step of {run_dir} was saved by every rank ({_held(steps)})")
    step = common[-1] if step is None else step
    check_param_layout(run_dir)
    if step not in common:
        saved_by = [r for r, s in steps.items() if step in s]
        why = (f"was saved by {len(saved_by)} of {len(steps)} ranks only" if saved_by
               else "is not a checkpointed step")
        raise ValueError(f"step {step} of {run_dir} {why}; steps all ranks hold: "
                         f"{', '.join(map(str, common)) or 'none'} ({_held(steps)})")
    full: dict = {}
    # Each rank's model parts, from its checkpoint's metadata alone (no array is loaded).
    paths = [run_dir / "checkpoints" / rank / str(step) / "state"
             for rank in sorted(steps, key=lambda r: int(r.split("_")[1]))]
    parts = {path: _saved_parts(path) for path in paths}
    for path, held in parts.items():
        if set(held) - {TIED_KEY} <= set(full):
            continue  # a data replica of parts already read: skip its weights
        state = read_state(path)
        if cfg.optim.offload and cfg.optim.shard_optimizer:
            state = _whole_master(state, path, [q for q, h in parts.items() if h == held])
        for key, part in master_params(state, cfg.optim.offload).items():
            if key != TIED_KEY:
                full.setdefault(key, part)
    names = Model(cfg.model).names
    missing = [k for k in names if k not in full]
    if missing:
        raise ValueError(f"the checkpoints of step {step} in {run_dir} lack {missing}: a rank's folder is "
                         f"missing ({', '.join(steps)} found)")
    return {k: jax.tree.map(lambda x: np.asarray(x, np.float32), full[k]) for k in names}, step, cfg


def _whole_master(state: dict, path: Path, replicas: list[Path]) -> dict:
    """``state`` (read from ``path``) with the offloaded masters of its stage whole: with
    ``optim.shard_optimizer`` each data replica saved its shard (``opt_state.shard`` = replica, replicas,
    parameters), put together here from ``replicas``' checkpoints (``path`` among them)."""
    shards = {}
    for q in replicas:
        opt = (state if q == path else read_state(q))["opt_state"]
        j, count, n = (int(v) for v in np.asarray(opt["shard"]))
        shards[j] = np.asarray(opt["master"])
    if sorted(shards) != list(range(count)):
        raise ValueError(f"the sharded optimizer's masters of parts {sorted(state['params'])} come in {count} "
                         f"shards; the checkpoints hold shards {sorted(shards)}")
    master = np.concatenate([shards[j] for j in range(count)])[:n]
    return {**state, "opt_state": {**state["opt_state"], "master": master}}


def _saved_parts(path: Path) -> list[str]:
    """The model parts in a rank's saved params, read from the checkpoint's metadata (no array is loaded)."""
    return list(state_metadata(path)["params"])


def _held(steps: dict[str, list[int]]) -> str:
    return "; ".join(f"{r}: {', '.join(map(str, s))}" for r, s in steps.items())


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> dict:
    """Write :func:`consolidate`'s weights to the new folder ``out`` (``params/<part>``, one orbax checkpoint
    per model part, so that a pipeline rank reads only its stage's; and ``export.json``), atomically: built
    under a temporary name, renamed when whole. Returns the metadata."""
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; give a new path")
    params, step, cfg = consolidate(run_dir, step)
    p = cfg.parallel
    meta = {"format": PARAM_LAYOUT, "step": step, "source": str(Path(run_dir).absolute()),
            "model": json.loads(json.dumps(dataclasses.asdict(cfg.model))),
            "layout": {"pipeline": p.pipeline, "data": p.data, "tensor": [p.tensor_col, p.tensor_row, p.tensor_depth],
                       "offload": cfg.optim.offload, "compute_dtype": cfg.precision.compute_dtype},
            "params": int(sum(x.size for x in jax.tree.leaves(params))), "parts": list(params)}
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    saver = ocp.StandardCheckpointer()
    for name, part in params.items():
        saver.save(tmp / PARAMS / name, part)
        saver.wait_until_finished()
    (tmp / META).write_text(json.dumps(meta, indent=1))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return meta


def read_meta(path: str | Path) -> dict:
    """``export.json`` of an export folder; ValueError naming the path when it is not one."""
    f = Path(path) / META
    if not f.is_file():
        if (Path(path) / "config.yaml").is_file():  # a run.dir: the export is made from it, into a new folder
            raise ValueError(f"{path} is the run.dir of a training run, not an export; make one from it with "
                             f"`jaxhybrid export --run-dir {path} --out NEW_FOLDER` and name NEW_FOLDER here")
        raise ValueError(f"{path} is not a jaxhybrid export (no {META}); make one with "
                         f"`jaxhybrid export --run-dir RUN --out {path}`")
    return json.loads(f.read_text())


def load_export(path: str | Path, parts=None) -> dict:
    """The exported weights as the model's flat dict (numpy float32), or only its ``parts``."""
    names = read_meta(path)["parts"] if parts is None else parts
    return {n: read_state(Path(path).absolute() / PARAMS / n) for n in names}


def check_init_from(cfg) -> None:
    """``train.init_from`` names an export made for this model's shapes; checked from the export's metadata
    and the configs alone, before anything is built (the launcher checks it too, so nothing here starts
    JAX). A resumed run ignores it (its own checkpoints supersede the weights it started from), so the
    command that started a run also continues it."""

    src = cfg.train.init_from
    if not src or cfg.run.resume:
        return
    try:
        meta = read_meta(src)
    except ValueError as e:
        raise ConfigError(f"train.init_from={src}: {e}") from None
    if meta.get("format", 1) != PARAM_LAYOUT:  # format 1 held layout 1's [q | k | v] qkv columns
        raise ConfigError(f"train.init_from={src} is an export of format {meta.get('format', 1)} (parameter "
                          f"layout: fused qkv columns as [q | k | v]); this jaxhybrid reads format {PARAM_LAYOUT} "
                          f"(grouped per key/value head, jaxhybrid/model/transformer.py): export the run again with "
                          f"the version that trained it and convert, or start from scratch")
    mine = shape_settings(json.loads(json.dumps(dataclasses.asdict(cfg.model))))
    diff = [f"model.{k} {v} there, {mine.get(k)} here" for k, v in shape_settings(meta["model"]).items()
            if mine.get(k) != v]
    if diff:
        raise ConfigError(f"train.init_from={src} holds weights of another shape than this run's model: "
                          f"{'; '.join(diff)}")


def params_for(live: dict, path: str | Path) -> dict:
    """The weights exported to ``path`` for a rank whose live parameters are ``live`` (its stage's parts,
    or the whole model), read part by part and placed like them (``place_like``, as a resume places its
    checkpoint): same dtype and sharding, on one device, a mesh, or a mesh spanning processes."""
    full = load_export(path, sorted({"embed" if k == TIED_KEY else k for k in live}))
    picked = {k: full["embed"]["wte"] if k == TIED_KEY else full[k] for k in live}

    def check(key, ref, x):
        if np.shape(x) != ref.shape:
            raise ValueError(f"train.init_from={path}: {jax.tree_util.keystr(key)} has shape {np.shape(x)} there, "
                             f"{ref.shape} here")

    jax.tree_util.tree_map_with_path(check, live, picked)
    return place_like(live, picked)
