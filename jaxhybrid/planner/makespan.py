"""The pipeline makespan of a schedule at given cost ratios, for the step model's thousands of layouts.

Scale-free (F = 1) and cached: the step model rounds its ratios to two significant digits (:func:`sig2`), so
a search of thousands of layouts runs a few hundred simulations.
"""
from __future__ import annotations

import functools

from jaxhybrid.parallel.pipeline.generators import gpipe_rows
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import Costs, memory_deltas, run_order
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule

# Tasks (stages x microbatches) simulated at most; longer schedules are extrapolated (pipeline_makespan).
MAX_SIMULATED = 2048


def sig2(x: float) -> float:
    """``x`` to two significant digits (the cache key's resolution)."""
    return float(f"{x:.2g}")


@functools.lru_cache(maxsize=4096)
def _fixed_schedule(schedule: str, p: int, m: int, split: bool, limit: int = 0):
    """A schedule whose rows do not depend on the costs, built once per shape for every ratio: any without
    2BP, and Myelin's, whose rows are only each rank's pool of tasks: the simulator's message-driven policy
    re-derives the order under the costs and ``limit`` (Alg. 2) and reads the rows only as a pool, so
    they are the pool as it is, not ordered by a run of the policy at unit costs (make_schedule's rows)."""

    if schedule == "myelin":
        rows = tuple(map(tuple, gpipe_rows(p, m, Kind.BI if split else Kind.B)))
        return Schedule("myelin", rows, tuple(range(p)), m, split, "message-driven", limit)
    return make_schedule(schedule, p, m, split)


def makespan_floor(p: int, m: int, split: bool, bi: float, bw: float, msg: float) -> float:
    """A makespan (F = 1) that no schedule or limit beats: the last stage starts only once the first
    forward has crossed the p - 1 stages and messages before it; it then runs all m microbatches' F and
    B (or BI, and BW: m (1 + bi + bw)), and its last backward still crosses the p - 1 stages back, with
    stage 0's BW of it after that under 2BP. Where a simulated makespan is within 1% of it, a larger
    Myelin limit (V-A) can gain at most 1% (the planner's search does not try one then)."""
    if not split:
        bi, bw = bi + bw, 0.0
    return (p - 1) * (1 + msg) + max(m * (1 + bi + bw), m * (1 + bi) + (p - 1) * (bi + msg) + bw)


def memory_states(core, p: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, the (stashed activations, held weight residuals) counts it passes through that no other
    state of it dominates (2BP Sec. 4.2: a microbatch's activations live from its F to its BI, or B, and
    its weight residuals from BI to BW). A rank's peak bytes are the largest ``a A + r R`` over its states,
    for any per-microbatch activation bytes ``A`` and residual bytes ``R``: its two separate peaks, which
    may fall at different times (under GPipe + 2BP they never meet), would overstate it."""

    records: list[list] = [[] for _ in range(p)]
    for rec in core.records:
        records[rec.rank].append(rec)
    out = []
    for rank in records:
        a = r = 0
        seen = {(0, 0)}
        for _, _, _, da, dr in memory_deltas(rank):
            a, r = a + da, r + dr
            seen.add((a, r))
        front, best_r = [], -1  # by activations, most first: a state survives if it holds more residuals
        for a_, r_ in sorted(seen, key=lambda x: (-x[0], -x[1])):
            if r_ > best_r:
                front.append((a_, r_))
                best_r = r_
        out.append(tuple(sorted(front)))
    return tuple(out)


def _simulate(schedule: str, p: int, m: int, split: bool, bi: float, bw: float, msg: float, limit: int = 0):
    """One simulation at these ratios. The schedule is built with them too, as ``jaxhybrid simulate
    --costs`` builds it: 2BP places its weight passes in the idle time the costs leave (unit costs
    placed them elsewhere: 35.5 against 34 for 1F1B + 2BP, 4 stages, 8 microbatches, costs 1, 2, 0.5)."""

    costs = Costs(forward=(1.0,) * p, backward_input=(bi,) * p, backward_weight=(bw,) * p,
                  message_bytes=(msg,) * p, bandwidth=1.0)
    fixed = not split or schedule in ("myelin", "zb-h1")  # ZB-H1 places its BWs by rule, not by costs
    # The engine builds 1F1B* from unit costs and free links (runner.py): equal stages, one per group, which
    # these ratios' links would regroup; only where its weight passes go follows the costs.
    star = {"groups": tuple(range(p, 0, -1))} if schedule == "1f1b-star" else {}
    order = (_fixed_schedule(schedule, p, m, split, limit) if fixed
             else make_schedule(schedule, p, m, split, costs=costs, **star))
    core = run_order(order, costs)
    return max(r.end for r in core.records), memory_states(core, p)


def _extrapolation_points(schedule: str, p: int, m: int, limit: int = 0) -> tuple[int, int]:
    """The two microbatch counts a long schedule's makespan is extrapolated from.

    GPipe and 1F1B (static rows): ``2p`` and ``3p``; past the fill every further microbatch adds one
    steady-state period to the bottleneck rank. Myelin (Alg. 2) is periodic in ``m`` with period ``p``,
    not 1: stage 0 injects ``pipeline_limit = p`` microbatches per round (V-A), a round's first extra
    microbatch costs more than the others, and its fill settles only after several rounds, so ``2p``/``3p``
    would overestimate. Both points are congruent to ``m`` modulo ``p``, the later one as far as
    ``MAX_SIMULATED`` tasks (at least ``6p``), the earlier one about half-way back: whole rounds between
    them and ``m``. A run's own ``limit`` (``pipeline.pipeline_limit``) makes a round ``limit``
    microbatches, and the period with it, so the points are then ``limit`` apart."""
    if schedule != "myelin":
        return 2 * p, 3 * p
    period = limit or p
    top = max(6 * p, p * (MAX_SIMULATED // (p * p)), 3 * period)
    m2 = top - (top - m) % period
    return m2 - period * max(1, m2 // (2 * period)), m2


@functools.lru_cache(maxsize=65536)
def pipeline_makespan(schedule: str, p: int, m: int, split: bool, bi: float, bw: float, msg: float,
                      limit: int = 0) -> tuple[float, tuple[tuple[tuple[int, int], ...], ...]]:
    """(makespan with F = 1, per-rank :func:`memory_states`); rank r runs stage r.

    Up to :data:`MAX_SIMULATED` tasks, one run of the schedule simulator. Longer schedules: the makespan
    is extrapolated linearly in ``m`` from two simulated ones (:func:`_extrapolation_points`; the tests
    hold it to a full simulation), and each rank's
    memory from the closed forms: GPipe stashes all m, 1F1B min(m, p - rank), and with 2BP the weight
    residuals of all m, counted as if held with them (an upper bound); ZB-H1 1F1B's activations and
    ``rank + 1`` residuals (both its exact peaks, simulated at p up to 16). Myelin (Alg. 2) keeps at most its
    pipeline limit in flight on every stage, and its 2BP engine at most ``weight_budget`` (p) weight
    residuals (:mod:`~jaxhybrid.parallel.pipeline.message_driven`): both bounds, counted as if held together.

    ``limit``: Myelin's ``pipeline_limit`` (V-A; 0, the engine's default, is p), as a run sets it; the
    other schedules have none."""
    limit = 0 if schedule != "myelin" or limit == p else limit  # one cache entry for the default
    m1, m2 = _extrapolation_points(schedule, p, m, limit)
    if p * m <= MAX_SIMULATED or m <= m2:
        return _simulate(schedule, p, m, split, bi, bw, msg, limit)
    (t1, _), (t2, _) = (_simulate(schedule, p, k, split, bi, bw, msg, limit) for k in (m1, m2))
    make = t2 + (m - m2) * (t2 - t1) / (m2 - m1)
    if schedule == "myelin":  # a later stage may hold all in flight (p - rank is 1F1B's bound, not Alg. 2's)
        return make, tuple(((min(m, limit or p), min(m, p) if split else 0),) for _ in range(p))
    live = [m if schedule == "gpipe" else min(m, p - r) for r in range(p)]
    if schedule == "zb-h1":  # 1F1B's activations; stage r delays its BWs by r backward passes (r + 1 held)
        return make, tuple(((a, min(m, r + 1)),) for r, a in enumerate(live))
    return make, tuple(((a, m if split else 0),) for a in live)
