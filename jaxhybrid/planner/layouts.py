"""The planner's search space: every layout of G GPUs that the trainer runs (Myelin's G_inter x G_data grid,
AxoNN's G_c x G_r x G_d mesh under it, a microbatch size, a schedule, 2BP, recomputation and offload).

A layout is kept only where the config validation would accept it, by the same rules: the schedule's
(microbatches >= stages) and the tensor engines' divisibility rules (:func:`tensor_fits`).
"""
from __future__ import annotations

import functools
import itertools

from jaxhybrid.config import TensorConfig
from jaxhybrid.model.config import REMATS, ModelConfig
from jaxhybrid.planner.step_model import Layout

# What the pipeline engine runs from a plan's overrides, any pipeline and microbatch count >= stages: GPipe,
# 1F1B, Myelin Alg. 2 (limit = stages, V-A) with and without 2BP; ZB-H1 (Qi et al.) splits always.
PLANNED_SCHEDULES = ("1f1b", "gpipe", "myelin", "zb-h1")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: ModelConfig, gpus: int, global_batch: int, tensor: bool = True, offload: bool | None = None,
            schedules=PLANNED_SCHEDULES, remats=REMATS, max_microbatch: int = 64):
    """All layouts of ``gpus`` GPUs that the config validation would accept."""
    offloads = (False, True) if offload is None else (offload,)
    for pipe in divisors(gpus):
        if pipe > cfg.n_layers:
            continue
        for data in divisors(gpus // pipe):
            rest = gpus // (pipe * data)
            grids = [(1, 1, 1)] if not tensor else [
                (c, r, rest // (c * r)) for c in divisors(rest) for r in divisors(rest // c)]
            if not tensor and rest != 1:
                continue
            if global_batch % data:
                continue
            for gc, gr, gd in grids:
                for b in divisors(global_batch // data):
                    m = global_batch // (data * b)
                    if b > max_microbatch or (pipe > 1 and m < pipe):
                        continue
                    mesh_data = data if pipe == 1 else 1  # tensor mode puts the replicas on the mesh
                    if gc * gr * gd > 1 and not tensor_fits(cfg, mesh_data, gd, gr, gc, b * mesh_data):
                        continue
                    scheds = schedules if pipe > 1 else ("1f1b",)  # one stage: gradient accumulation
                    for sched, split, remat, off in itertools.product(scheds, (False, True), remats, offloads):
                        # 2BP needs a pipeline to fill; ZB-H1 always splits.
                        if (split and pipe == 1) or (sched == "zb-h1" and not split):
                            continue
                        yield Layout(pipe, data, gc, gr, gd, b, m, sched, split, off, remat)


@functools.lru_cache(maxsize=4096)
def tensor_fits(cfg: ModelConfig, data: int, depth: int, row: int, col: int, rows: int) -> bool:
    """Whether the tensor engines accept the mesh (:func:`~jaxhybrid.tensor.sharding.check_layout`, the rule
    the config validation applies): every split dim, the vocabulary over col among them, and the batch rows
    over data x depth."""
    from jaxhybrid.tensor.mesh import MeshShape
    from jaxhybrid.tensor.sharding import check_layout

    try:
        check_layout(cfg, MeshShape(data, depth, row, col), rows, TensorConfig.optimizations)
    except ValueError:
        return False
    return True
