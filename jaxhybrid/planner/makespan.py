"""The pipeline makespan of a schedule at given cost ratios, for the step model's thousands of layouts.

Scale-free (F = 1) and cached: the step model rounds its ratios to two significant digits (:func:`sig2`), so
a search of thousands of layouts runs a few hundred simulations; each schedule is built once per shape.
"""
from __future__ import annotations

import functools


def sig2(x: float) -> float:
    """``x`` to two significant digits (the cache key's resolution)."""
    return float(f"{x:.2g}")


@functools.lru_cache(maxsize=4096)
def _schedule(schedule: str, p: int, m: int, split: bool):
    """Schedules are data and depend on no cost: one per shape serves every ratio of a search."""
    from jaxhybrid.pipeline.schedule import make_schedule

    return make_schedule(schedule, p, m, split)


@functools.lru_cache(maxsize=65536)
def pipeline_makespan(schedule: str, p: int, m: int, split: bool, bi: float, bw: float, msg: float,
                      ) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(makespan, peak stashed microbatches per rank, peak residual microbatches per rank) with F = 1
    (scale-free); rank r runs stage r.

    Uses the schedule simulator (one run; the two peaks are read from it with unit activation bytes and
    with unit residual bytes); very long schedules fall back to the closed forms (m + p - 1)(F + B) for
    GPipe/1F1B and m(F + B) + (p - 1)(F + BI) with 2BP.
    """
    if p * m <= 2048:
        from jaxhybrid.pipeline.simulate import Costs, peak_bytes, run_order

        def costs(act, res):
            return Costs(forward=(1.0,) * p, backward_input=(bi,) * p, backward_weight=(bw,) * p,
                         activation_bytes=(act,) * p, residual_bytes=(res,) * p,
                         message_bytes=(msg,) * p, bandwidth=1.0)

        core = run_order(_schedule(schedule, p, m, split), costs(1.0, 0.0))
        makespan = max(r.end for r in core.records)
        act = tuple(peak_bytes(core, costs(1.0, 0.0)))
        res = tuple(peak_bytes(core, costs(0.0, 1.0))) if split else (0.0,) * p
        return makespan, act, res  # peaks may not coincide: act + res bounds the memory from above
    span = (1 + bi + bw)
    make = m * span + (p - 1) * ((1 + bi) if split else span) + 2 * (p - 1) * msg
    live = [float(m if schedule == "gpipe" else min(m, p - r)) for r in range(p)]
    return make, tuple(live), tuple(m - x if split else 0.0 for x in live)
