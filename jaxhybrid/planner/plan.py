"""Ranked plans: every feasible layout of G GPUs, best predicted step time first.

A layout (:mod:`jaxhybrid.planner.layouts`) is pipeline x data x G_c x G_r x G_d = G, a microbatch size, a
schedule (GPipe, 1F1B or Myelin's message-driven Alg. 2 at a few pipeline limits, V-A, each with or without
the 2BP split; ZB-H1 with it; interleaved 1F1B and ZB-V over several stages per rank, with the activations
their schedules stash), activation recomputation (none, dots, or Myelin's checkpoint interval) and
optimizer offload. Each is scored by :func:`jaxhybrid.planner.step_model.evaluate`; layouts whose memory
per device exceeds the hardware's are dropped. A plan file (``--out``) carries the config overrides that
``jaxhybrid train --set plan.file=PLAN.json`` applies (:func:`load_plan_overrides`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxhybrid.core.config.model import ModelConfig, shape_settings
from jaxhybrid.core.config.schema import OptimConfig, TensorConfig
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.planner.costs import read_json
from jaxhybrid.planner.layouts import divisors, search, tensor_fits
from jaxhybrid.planner.machine import machine_from_hardware  # noqa: F401  (planner.plan's API)
from jaxhybrid.planner.step_model import Layout, Machine, evaluate

PLAN_KEYS = ("pipeline", "data", "tensor_col", "tensor_row", "tensor_depth", "microbatch_size", "schedule",
             "pipeline_limit", "virtual_stages", "placement", "split_backward", "offload", "shard_optimizer",
             "predicted_step_s", "comm_s", "memory_per_device_bytes")
LATENCY_FLOOR_S = 5e-6  # "a few microseconds": below it a collective's latency, not its bytes, sets its time


def check_gpus(gpus: int, gpus_per_node: int) -> None:
    """G must be whole nodes or an aligned part of one node. AxoNN's bandwidth model (Sec. V;
    :func:`~jaxhybrid.planner.comm_model.group_bandwidths`) puts every process group in an aligned block of
    consecutive GPUs that is either inside one node (and divides it) or whole nodes; Assumption 6 (powers
    of two) implies this. Any other count leaves some node partly used in a way no such block describes."""
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"--gpus={gpus} and --gpus-per-node={gpus_per_node} must be >= 1")
    if gpus % gpus_per_node and gpus_per_node % gpus:
        raise ValueError(f"--gpus={gpus} is neither a multiple of --gpus-per-node={gpus_per_node} (whole nodes) "
                         f"nor a divisor of it (an aligned part of one node); AxoNN's communication model "
                         f"(Sec. V) has no other partly used nodes")


def rank_plans(cfg: ModelConfig, gpus: int, machine: Machine, global_batch: int, seq: int, top: int = 10,
               tensor: bool = True, offload: bool | None = None, bucket_size: int = OptimConfig.bucket_size,
               letters: str = TensorConfig.optimizations, allreduce_dtype: str = OptimConfig.allreduce_dtype,
               allreduce_backend: str = OptimConfig.allreduce_backend,
               shard_optimizer: bool = OptimConfig.shard_optimizer) -> list[dict]:
    """Feasible plans, best predicted step first; raises ValueError when none fits, with the fix, or when
    ``gpus`` is not whole nodes or a divisor of one (:func:`check_gpus`). Offloaded layouts hold buckets
    of ``bucket_size`` elements (the run's ``optim.bucket_size``: a plan file leaves it as it is). ``letters``
    (``tensor.optimizations``), ``allreduce_dtype`` (``optim.allreduce_dtype``: Myelin IV-B's
    half-precision all-reduce) and ``allreduce_backend`` (``optim.allreduce_backend``: MPI through host
    memory, or XLA's collectives) are the run's too, as :func:`score_config` scores its own layout: a plan
    file leaves them as they are, and the config's layout is ranked among plans scored the same way.
    ``shard_optimizer``: every layout whose data replicas are MPI ranks of one device
    (``ParallelDims.replicas_are_ranks``, the config's rule) divides its optimizer state over them
    (``optim.shard_optimizer``, ZeRO-1)."""
    if gpus < 1 or global_batch < 1 or seq < 1:
        raise ValueError(f"gpus={gpus}, global_batch={global_batch}, seq={seq} must be >= 1")
    check_gpus(gpus, machine.net.gpus_per_node)
    plans, smallest = [], None

    def sharded(lay: Layout) -> Layout:
        return dataclasses.replace(lay, shard_optimizer=shard_optimizer and lay.dims.replicas_are_ranks)

    def score(lay: Layout) -> dict:
        return evaluate(cfg, sharded(lay), machine, seq, bucket_size, letters, allreduce_dtype, allreduce_backend)

    for lay, r, fits in search(cfg, gpus, global_batch, score, machine.memory_bytes, tensor, offload):
        lay = sharded(lay)
        if smallest is None or r["memory_per_device_bytes"] < smallest[0]:
            smallest = (r["memory_per_device_bytes"], lay)
        if fits:
            plans.append({**lay.to_dict(), **r})
    if smallest is None:
        raise ValueError(f"no layout of {gpus} GPUs is valid for {cfg.name} (n_layers={cfg.n_layers}, "
                         f"global batch {global_batch}); use a GPU count that divides the batch and the layers")
    if not plans:
        more = _smallest_gpus(cfg, gpus, machine, tensor, score)
        raise ValueError(
            f"{cfg.name} ({cfg.param_count() / 1e9:.3g}B parameters) does not fit on {gpus} GPUs with "
            f"{machine.memory_bytes / 1e9:.3g} GB usable each: the leanest layout ({_describe(smallest[1])}) needs "
            f"{smallest[0] / 1e9:.3g} GB per device; {more}")
    plans.sort(key=lambda p: p["predicted_step_s"])
    return plans[:top]


def latency_notes(plans: list[dict]) -> list[str]:
    """A note when some listed plan predicts every collective under a few microseconds. AxoNN's model
    (eqs. 1-9, Assumption 3) is bandwidth-only, and the step model adds no latency or launch term, so at
    that size the real per-collective latency dominates and the ranking compares meaningless numbers."""
    small = [i for i, p in enumerate(plans) if 0 < p["max_collective_s"] < LATENCY_FLOOR_S]
    if not small:
        return []
    which = f"all {len(plans)} plans" if len(small) == len(plans) else "plans " + ", ".join(f"#{i}" for i in small)
    return [f"every collective of {which} is predicted under {LATENCY_FLOOR_S * 1e6:g} us "
            f"(max_collective_s); the communication model is bandwidth-only (AxoNN eqs. 1-9) and "
            f"ignores latency, so such small configurations are not ranked meaningfully"]


def _sizes(p: dict) -> tuple[int, ...]:
    return tuple(p[k] for k in ("pipeline", "data", "tensor_col", "tensor_row", "tensor_depth"))


def virtual_stage_notes(plans: list[dict]) -> list[str]:
    """A note when the best of ``plans`` (feasible ones, best first, as :func:`rank_plans` returns them) runs
    several stages per rank: whether it needs them to fit (no plan of one stage per rank with its
    pipeline, data and tensor sizes fits) or wins on time, by how much against the best such plan."""
    if not plans or plans[0].get("virtual_stages", 1) == 1:
        return []
    best = plans[0]
    what = (f"the best plan runs {best['virtual_stages']} stages per pipeline rank ({best['schedule']}, "
            f"placement {best['placement']})")
    ones = [p for p in plans if p.get("virtual_stages", 1) == 1]
    faster = "" if not ones else (
        f"{1 - best['predicted_step_s'] / ones[0]['predicted_step_s']:.1%} faster than the best plan of one stage "
        f"per rank ({ones[0]['schedule']}, {ones[0]['predicted_step_s']:.4g} s against {best['predicted_step_s']:.4g} s)")
    if not any(_sizes(p) == _sizes(best) for p in ones):
        sizes = "x".join(map(str, _sizes(best)))
        return [f"{what}: it needs them to fit, no plan of one stage per rank with its pipeline x data x tensor "
                f"sizes ({sizes}) fits in memory" + (f"; it is {faster}" if faster else "")]
    return [f"{what}: it wins on time, {faster}"]


def _describe(lay: Layout) -> str:
    d = lay.dims
    return (f"pipeline={d.pipeline} data={d.data} tensor={d.tensor_col}x{d.tensor_row}x"
            f"{d.tensor_depth} microbatch={lay.microbatch_size} offload={lay.offload} remat={lay.remat}")


def _larger_counts(gpus: int, gpus_per_node: int, limit: int):
    """GPU counts above ``gpus`` that :func:`check_gpus` accepts: the larger divisors of a node, then
    doubling whole nodes."""
    yield from (d for d in divisors(gpus_per_node) if d > gpus)
    g = max(gpus, gpus_per_node) * 2
    while g <= limit:
        yield g
        g *= 2


def _smallest_gpus(cfg, gpus, machine, tensor, score) -> str:
    """Grow the GPU count until the leanest layout fits: pipeline x tensor only (data replicas do not
    lower memory per device), the smallest microbatch (1, or the depth's size), as many microbatches as
    stages, recomputation on, and the optimizer offloaded; ``score`` is the plans' own (the run's buckets and
    tensor optimizations: E's cached all-gathers hold memory)."""
    for g in _larger_counts(gpus, machine.net.gpus_per_node, gpus * 4096):
        for pipe in divisors(g):
            rest = g // pipe
            if pipe > cfg.n_layers or (not tensor and rest > 1):
                continue
            for c in divisors(rest):
                for r in divisors(rest // c):
                    d = rest // (c * r)  # depth splits the microbatch's rows: at least d of them
                    if rest > 1 and not tensor_fits(cfg, pipe, 1, d, r, c, d):
                        continue
                    lay = Layout(ParallelDims(pipe, 1, c, r, d), d, pipe, "1f1b", False, True, "full")
                    if score(lay)["memory_per_device_bytes"] <= machine.memory_bytes:
                        return (f"{g} GPUs would fit ({_describe(lay)}; recomputation on; "
                                f"at least {pipe} microbatches per step)")
    return f"even {gpus * 4096} GPUs do not fit; use a larger-memory device"


def plan_overrides(plan: dict, global_batch: int, dtype: str | None = None, seq_len: int | None = None) -> dict:
    """The nested config overrides of a plan (keys of :class:`jaxhybrid.core.config.schema.Config`); ``dtype`` and
    ``seq_len`` are the compute dtype and sequence length the plan's times and memory were modelled with, so
    the run trains with them too (a run at 4x the tokens would hold 4x the activations the plan counted)."""
    axes = ("pipeline", "data", "tensor_col", "tensor_row", "tensor_depth")
    partition = list(plan["partition"]) if plan["pipeline"] > 1 else []
    pipe = {"schedule": plan["schedule"], "split_backward": plan["split_backward"],
            "microbatches": plan["microbatches"], "virtual_stages": plan.get("virtual_stages", 1),
            "placement": plan.get("placement", "loop")}
    # The limit it was modelled with (0: stages), whatever the run set; 0 under the other schedules, which
    # have no limit (a run config's own Myelin limit would be an error with them).
    pipe["pipeline_limit"] = plan.get("pipeline_limit", 0) if plan["schedule"] == "myelin" else 0
    # Myelin V-C's coarsening and IV-B's half-precision wire exist only for the offloaded optimizer, the
    # latter on MPI replicas in half precision (config_checks): where the plan has none, it resets the run's
    # to what it was scored with, so a plan of a config like myelin-50b-offload.yaml applies to it.
    optim = ({"offload": plan["offload"]} | ({} if plan["offload"] else {"allreduce_coarsening": 1})
             | ({"shard_optimizer": True} if plan.get("shard_optimizer") else {}))
    if not plan["offload"] or dtype == "float32" or (plan["pipeline"] == 1 and any(plan[k] > 1 for k in axes[2:])):
        optim["allreduce_dtype"] = "float32"
    out = {"parallel": {k: plan[k] for k in axes} | {"partition": partition}, "pipeline": pipe, "optim": optim,
           "train": {"global_batch": global_batch, "remat": plan["remat"]}}
    return (out | ({"precision": {"compute_dtype": dtype}} if dtype else {})
            | ({"data": {"seq_len": seq_len}} if seq_len else {}))


def config_layout(cfg) -> Layout:
    """The :class:`Layout` a run config trains with (the inverse of :func:`plan_overrides`), so the step
    model can score a hand-written config beside the planner's own plans. The step model splits the blocks
    its own way (:func:`~jaxhybrid.planner.step_model.chunk_partition`), not by ``parallel.partition``.
    ``pipeline.pipeline_limit`` counts only under Myelin's message-driven schedule (the engine's rule);
    ``pipeline.virtual_stages``, ``placement`` and ``optim.shard_optimizer`` are the run's."""
    dims, pl = cfg.layout, cfg.pipeline
    return Layout(dims, cfg.microbatch_size, pl.microbatches, pl.schedule, pl.split_backward and dims.pipeline > 1,
                  cfg.optim.offload, cfg.train.remat, pl.pipeline_limit if pl.schedule == "myelin" else 0,
                  pl.virtual_stages, pl.placement, cfg.optim.shard_optimizer)


def score_config(cfg, machine: Machine, seq: int, allreduce_backend: str | None = None) -> dict:
    """The step model's prediction for a run config's own layout, with its own offload bucket size and
    all-reduce (``allreduce_backend`` replaces ``optim.allreduce_backend``)."""
    return evaluate(cfg.model, config_layout(cfg), machine, seq, cfg.optim.bucket_size, cfg.tensor.optimizations,
                    cfg.optim.allreduce_dtype, allreduce_backend or cfg.optim.allreduce_backend)


def write_plan(path: str | Path, plan: dict, meta: dict) -> None:
    config = plan_overrides(plan, meta["global_batch"], meta.get("dtype"), meta.get("seq_len"))
    Path(path).write_text(json.dumps({**meta, "plan": plan, "config": config}, indent=1))


def load_plan_overrides(path: str | Path, model: str | None = None, shape: dict | None = None) -> dict:
    """Read a plan file from ``jaxhybrid plan --out`` and return its nested config overrides. With ``model``
    (the run's ``model.name``), a plan made for another model is a ConfigError naming both: its layout,
    partition and memory were modelled for that one. With ``shape`` (the run's model settings, as
    ``dataclasses.asdict`` gives them), so is a plan for the same preset with other sizes (a run config's
    ``model.d_model``, ``n_layers``, ...), each named. A plan without a "model" ("model_config") entry is not
    checked for it."""

    p = Path(path)
    data = read_json(p, "plan file")
    if isinstance(data, dict) and data.get("kind") == "allocation":
        data = {**data, "config": allocation_overrides(data, p, None if shape is None else shape.get("n_layers"))}
    cfg = data.get("config") if isinstance(data, dict) else None
    if not isinstance(cfg, dict) or not {"parallel", "pipeline", "optim"} <= set(cfg):
        raise ValueError(f"plan file {p} has no 'config' with parallel/pipeline/optim overrides; "
                         f"write it with `jaxhybrid plan ... --out {p.name}`")
    pipe = cfg["pipeline"]
    if isinstance(pipe, dict) and pipe.get("schedule", "myelin") != "myelin":  # files from before plan_overrides set it
        pipe.setdefault("pipeline_limit", 0)
    planned = data.get("model")
    if model is not None and planned is not None and planned != model:
        raise ConfigError(f"plan.file={p} was made for model {planned!r}, but this run trains model.name="
                          f"{model!r}; write a plan for it (jaxhybrid plan --model {model} ... --out {p.name})")
    if shape is not None and isinstance(data.get("model_config"), dict):
        # The settings that shape the parameters, as train.init_from compares them (rope_theta, ... aside).

        mine = shape_settings(shape)
        diff = [f"model.{k} {v} there, {mine.get(k)} here" for k, v in shape_settings(data["model_config"]).items()
                if mine.get(k) != v]
        if diff:
            raise ConfigError(f"plan.file={p} was made for another size of model {planned!r}: {'; '.join(diff)}; "
                              f"write a plan for this run's (jaxhybrid plan --model YOUR_CONFIG.yaml ... --out "
                              f"{p.name})")
    return cfg


def write_allocation(path: str | Path, alloc: dict, meta: dict) -> None:
    """A plan file of a MadPipe or PipeDream allocation (``jaxhybrid partition --out``): its stages (layer
    ranges in chain order, each with its processor), the periodic pattern of its valid schedule and the
    predicted periods; ``meta`` names the model and sizes it was profiled for, where known. The config
    overrides are derived from the stages when the file is loaded (:func:`allocation_overrides`)."""
    if not alloc["stages"] or not alloc["pattern"]:
        raise ValueError("the allocation has no valid schedule to write")
    Path(path).write_text(json.dumps({"kind": "allocation", **meta, **alloc}, indent=1))


def allocation_overrides(data: dict, path: Path, n_layers: int | None = None) -> dict:
    """The config overrides that train an allocation file: one pipeline rank per processor
    (``parallel.pipeline``), each stage's blocks (``parallel.partition``), its processor
    (``pipeline.stage_to_rank``) and the ``periodic`` schedule of its pattern (MadPipe Sec. 3-4). Raises
    ConfigError, naming the layers, where the stages leave a layer out, give one twice, or do not cover
    ``n_layers`` (the run's model blocks), and where a processor between them holds no stage."""
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages or not all(
            isinstance(st, dict) and isinstance(st.get("layers"), list) and len(st["layers"]) == 2
            and all(isinstance(x, int) for x in st["layers"]) and isinstance(st.get("processor"), int)
            for st in stages):
        raise ConfigError(f"plan.file={path}: 'stages' must be a list of {{\"layers\": [first, last], "
                          f"\"processor\": p}}; write it with `jaxhybrid partition ... --out {path.name}`")
    ranges = sorted((st["layers"][0], st["layers"][1], st["processor"]) for st in stages)
    count = [0] * (max(hi for _, hi, _ in ranges) + 1)
    for lo, hi, _ in ranges:
        if lo < 0 or hi < lo:
            raise ConfigError(f"plan.file={path}: a stage has layers [{lo}, {hi}]; need 0 <= first <= last")
        for layer in range(lo, hi + 1):
            count[layer] += 1
    out = [i for i, c in enumerate(count) if c == 0]
    twice = [i for i, c in enumerate(count) if c > 1]
    if out or twice:
        said = ([f"leaves layer{'s' if len(out) > 1 else ''} {', '.join(map(str, out))} out"] if out else []) + \
            ([f"gives layer{'s' if len(twice) > 1 else ''} {', '.join(map(str, twice))} to two stages"] if twice else [])
        raise ConfigError(f"plan.file={path}: the allocation {' and '.join(said)} (stages {[r[:2] for r in ranges]}); "
                          f"every layer belongs to exactly one stage")
    if n_layers is not None and len(count) != n_layers:
        raise ConfigError(f"plan.file={path} allocates {len(count)} layers (0..{len(count) - 1}), but this run's "
                          f"model has model.n_layers={n_layers} blocks; partition a profile of this model "
                          f"(jaxhybrid partition --profile-model YOUR_CONFIG.yaml ... --out {path.name})")
    procs = [r for *_, r in ranges]
    idle = sorted(set(range(max(procs) + 1)) - set(procs))
    if min(procs) < 0 or idle:
        raise ConfigError(f"plan.file={path}: processors {sorted(set(procs))} must be 0..{max(procs)}, each "
                          f"holding a stage")
    pipe = {"schedule": "periodic", "stage_to_rank": procs, "pattern": list(data.get("pattern") or ()),
            "virtual_stages": 1, "placement": "loop", "pipeline_limit": 0}
    out_cfg = {"parallel": {"pipeline": max(procs) + 1, "partition": [hi - lo + 1 for lo, hi, _ in ranges]},
               "pipeline": pipe, "optim": {}}
    if data.get("dtype"):
        out_cfg["precision"] = {"compute_dtype": data["dtype"]}
    if data.get("seq_len"):
        out_cfg["data"] = {"seq_len": data["seq_len"]}
    return out_cfg


def trace_line(traced: dict, plan_file: str = "") -> str:
    """What a traced step measured (``metrics.trace``): its bubble ratio, makespan and period, beside the
    period an allocation plan file predicted (``valid_period_s`` of ``jaxhybrid partition --out``: the
    profile's costs under the valid schedule, MadPipe Sec. 4.3)."""
    line = f"traced step: makespan {traced['makespan_s']:.4g} s, bubble ratio {traced['bubble_ratio']:.3f}"
    if traced.get("period_s") is not None:
        line += f", period {traced['period_s']:.4g} s per microbatch (last stage's forwards)"
    if traced.get("exposed_reduction_s") is not None:
        line += f", exposed data-parallel reduction {traced['exposed_reduction_s']:.4g} s (the longest rank's)"
    data = read_json(Path(plan_file), "plan file") if plan_file else {}
    if data.get("kind") == "allocation" and data.get("valid_period_s") is not None:
        line += (f"; plan.file={plan_file} predicted a period of {data['valid_period_s']:.4g} s "
                 f"({data['algorithm']} on its profile)")
    return line
