"""The planner's search space: every layout of G GPUs that the trainer runs (Myelin's G_inter x G_data grid,
AxoNN's G_c x G_r x G_d mesh under it, a microbatch size, a schedule, 2BP, recomputation and offload).

A layout is kept only where the config validation would accept it, by the same rules: the schedule's
(microbatches >= stages) and the tensor engines' divisibility rules (:func:`tensor_fits`). :func:`search`
walks it for the planner, scoring a larger Myelin limit (V-A) only where it may pay.

Several stages per rank (``pipeline.virtual_stages`` v, :data:`VIRTUAL_STAGES`): interleaved 1F1B (loop
placement, Narayanan et al. SC'21: a bubble of (p - 1) / (v m + p - 1) for more stashed activations) with and
without 2BP where M is a multiple of p, and ZB-V (Qi et al., ICLR'24: v = 2, V placement, split); each
only where the p v stages have a block each, the config validation's rule.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

from jaxhybrid.core.config.model import REMATS, ModelConfig
from jaxhybrid.core.config.schema import TensorConfig
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.parallel.tensor.sharding import run_layout_error
from jaxhybrid.planner.step_model import Layout

# What the pipeline engine runs from a plan's overrides, any pipeline and microbatch count >= stages: GPipe,
# 1F1B, Myelin Alg. 2 (at the limits of :func:`myelin_limits`) with and without 2BP; ZB-H1 (Qi et al.)
# splits always; over several stages per rank (:func:`chunkings`) interleaved 1F1B with and without 2BP, and
# ZB-V, split.
PLANNED_SCHEDULES = ("1f1b", "gpipe", "myelin", "zb-h1", "interleaved-1f1b", "zb-v")
# Interleaved 1F1B's stages per rank searched: each halves the bubble again for more messages and a longer
# warm-up's activations; past 4 the messages outweigh what is left of the bubble.
VIRTUAL_STAGES = (2, 4)


# A larger Myelin limit is scored only where the pipeline time exceeds its floor by more than this, the
# most it could gain: below the step model's resolution (its cost ratios are rounded to 2 digits).
LIMIT_SLACK = 0.01


def myelin_limits(p: int, m: int, split: bool) -> tuple[int, ...]:
    """The ``pipeline_limit`` values searched for Myelin's Alg. 2 with p stages and m microbatches, smallest
    first: 0 (the engine's default: p, as V-A fixes it), 3p/2 and, without 2BP, 2p; at most m (more is m).

    V-A fixes the limit at G_inter so that every GPU can compute; but p in flight keep p stages busy only
    if a microbatch's round trip has no waits, and its 2(p - 1) messages and the interleaving of forwards
    and backwards on each stage add some. In simulation 3p/2 recovers most of that, 2p most of the rest,
    and 3p little more, so the search stops at 2p; with 2BP, whose engine holds at most p microbatches'
    weight residuals, 2p adds next to nothing over 3p/2 and is left out. p/2 halves the activations in
    flight but lengthens the makespan by half or more, so the layouts it lets fit never rank near the
    best plan: it is not searched."""
    larger = {min(m, k * p // 2) for k in ((3,) if split else (3, 4))}
    return (0,) + tuple(sorted(lim for lim in larger if lim > p))


def chunkings(sched: str, n_layers: int, p: int, m: int) -> tuple[tuple[int, str], ...]:
    """The ``(virtual_stages, placement)`` a schedule is searched with at p ranks and m microbatches: one
    stage per rank for the schedules of one, :data:`VIRTUAL_STAGES` for interleaved 1F1B (M a multiple of
    p), ZB-V's (2, v); only where the p v stages have a block each (else none)."""
    if sched == "interleaved-1f1b":
        return tuple((v, "loop") for v in VIRTUAL_STAGES if p * v <= n_layers and m % p == 0)
    if sched == "zb-v":
        return ((2, "v"),) if 2 * p <= n_layers else ()
    return ((1, "loop"),)


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
                    if gc * gr * gd > 1 and not tensor_fits(cfg, pipe, data, gd, gr, gc, b):
                        continue
                    scheds = schedules if pipe > 1 else ("1f1b",)  # one stage: gradient accumulation
                    for sched, split, remat, off in itertools.product(scheds, (False, True), remats, offloads):
                        # 2BP needs a pipeline to fill; ZB-H1 and ZB-V always split.
                        if (split and pipe == 1) or (sched in ("zb-h1", "zb-v") and not split):
                            continue
                        for v, place in chunkings(sched, cfg.n_layers, pipe, m):
                            for lim in myelin_limits(pipe, m, split) if sched == "myelin" else (0,):
                                yield Layout(ParallelDims(pipe, data, gc, gr, gd), b, m, sched, split, off, remat,
                                             lim, v, place)


def _chain_start(lay: Layout) -> Layout:
    """The first of the layouts :func:`search` scores in a row, each only where the one before it pays:
    the default Myelin limit, or the fewest virtual stages searched."""
    return dataclasses.replace(lay, pipeline_limit=0, virtual_stages=min(lay.virtual_stages, VIRTUAL_STAGES[0]))


def search(cfg: ModelConfig, gpus: int, global_batch: int, score, memory_bytes: float, tensor: bool = True,
           offload: bool | None = None):
    """``(layout, score(layout), fits)`` for the :func:`layouts` worth scoring; ``fits``: within
    ``memory_bytes`` and, for a larger Myelin limit or more virtual stages, faster than the one before it
    (else it holds more for nothing). A larger limit (more virtual stages) is scored only where the one
    before it fits, is faster than its own predecessor (or is the first), and is more than
    :data:`LIMIT_SLACK` above the pipeline time no limit beats (``pipeline_floor_s``). Each is a
    simulation, and few larger limits gain much: the floor skips most of those that cannot, so the search
    costs little more than with the default limit alone; interleaving's 4 stages per rank (the longest
    simulations) are scored only where 2 fit."""
    last = (None, False, 0.0)  # (the chain's first layout, worth the next one, step time)
    for lay in layouts(cfg, gpus, global_batch, tensor, offload):
        base = _chain_start(lay)
        larger = lay != base
        if larger and not (last[0] == base and last[1]):
            continue  # layouts() yields a chain in a row, its first layout first
        r = score(lay)
        fits = r["memory_per_device_bytes"] <= memory_bytes and (not larger or r["predicted_step_s"] < last[2])
        last = (base, fits and r["pipeline_s"] > (1 + LIMIT_SLACK) * r["pipeline_floor_s"], r["predicted_step_s"])
        yield lay, r, fits


@functools.lru_cache(maxsize=4096)
def tensor_fits(cfg: ModelConfig, pipeline: int, data: int, depth: int, row: int, col: int, microbatch: int) -> bool:
    """Whether the tensor engines accept the mesh the layout builds: the rule the config validation applies
    (:func:`~jaxhybrid.parallel.tensor.sharding.run_layout_error`), cached per layout shape."""

    return run_layout_error(cfg, pipeline, data, depth, row, col, microbatch, TensorConfig.optimizations) is None
