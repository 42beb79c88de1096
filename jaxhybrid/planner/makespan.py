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
def _fixed_schedule(schedule: str, p: int, m: int, split: bool, limit: int = 0, v: int = 1, placement: str = "loop"):
    """A schedule whose rows do not depend on the costs, built once per shape for every ratio: any without
    2BP, and Myelin's, whose rows are only each rank's pool of tasks: the simulator's message-driven policy
    re-derives the order under the costs and ``limit`` (Alg. 2) and reads the rows only as a pool, so
    they are the pool as it is, not ordered by a run of the policy at unit costs (make_schedule's rows)."""

    if schedule == "myelin":
        rows = tuple(map(tuple, gpipe_rows(p, m, Kind.BI if split else Kind.B)))
        return Schedule("myelin", rows, tuple(range(p)), m, split, "message-driven", limit)
    return make_schedule(schedule, p, m, split, virtual_stages=v, placement=placement)


def makespan_floor(p: int, m: int, split: bool, bi: float, bw: float, msg: float, v: int = 1) -> float:
    """A makespan (F = 1) that no schedule or limit beats: the last stage starts only once the first
    forward has crossed the p - 1 stages and messages before it; it then runs all m microbatches' F and
    B (or BI, and BW: m (1 + bi + bw)), and its last backward still crosses the p - 1 stages back, with
    stage 0's BW of it after that under 2BP. Where a simulated makespan is within 1% of it, a larger
    Myelin limit (V-A) can gain at most 1% (the planner's search does not try one then).

    With ``v`` stages per rank (costs per chunk, F = 1): rank p - 1 holds no stage below p - 1 under
    either placement, so it starts after p - 1 forwards and messages, then runs its v m chunks' work."""
    if not split:
        bi, bw = bi + bw, 0.0
    if v > 1:
        return (p - 1) * (1 + msg) + v * m * (1 + bi + bw)
    return (p - 1) * (1 + msg) + max(m * (1 + bi + bw), m * (1 + bi) + (p - 1) * (bi + msg) + bw)


def memory_states(core, p: int, v: int = 1) -> tuple[tuple[tuple, ...], ...]:
    """Per rank, the (stashed activations, held weight residuals) counts it passes through that no other
    state of it dominates (2BP Sec. 4.2: a microbatch's activations live from its F to its BI, or B, and
    its weight residuals from BI to BW). A rank's peak bytes are the largest ``a A + r R`` over its states,
    for any per-microbatch activation bytes ``A`` and residual bytes ``R``: its two separate peaks, which
    may fall at different times (under GPipe + 2BP they never meet), would overstate it.

    With ``v`` > 1 stages per rank a state is a pair of per-chunk count tuples (the rank's stages in
    ascending order): its chunks keep different bytes (the last stage's head), so a rank's peak is the
    largest ``sum_c a_c A_c + r_c R_c``; the states kept are those no other dominates in every count."""
    if v > 1:
        return _chunk_states(core, p, v)
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


def _chunk_states(core, p: int, v: int) -> tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], ...]:
    """:func:`memory_states` of a schedule with ``v`` stages per rank: per-chunk counts, undominated."""
    owner = core.stage_to_rank
    chunk = [owner[:s].count(owner[s]) for s in range(len(owner))]  # a stage's index among its rank's
    records: list[list] = [[] for _ in range(p)]
    for rec in core.records:
        records[rec.rank].append(rec)
    out = []
    for rank in records:
        a, r = [0] * v, [0] * v
        seen = {((0,) * v, (0,) * v)}
        for _, _, s, da, dr in memory_deltas(rank):
            a[chunk[s]] += da
            r[chunk[s]] += dr
            seen.add((tuple(a), tuple(r)))
        flat = sorted(seen, key=lambda x: -sum(x[0]) - sum(x[1]))
        front: list = []
        for st in flat:  # most held first: one dominated by a kept state is left out
            if not any(all(x <= y for x, y in zip(st[0] + st[1], f[0] + f[1])) for f in front):
                front.append(st)
        out.append(tuple(sorted(front)))
    return tuple(out)


def _simulate(schedule: str, p: int, m: int, split: bool, bi: float, bw: float, msg: float, limit: int = 0,
              v: int = 1, placement: str = "loop"):
    """One simulation at these ratios. The schedule is built with them too, as ``jaxhybrid simulate
    --costs`` builds it: 2BP places its weight passes in the idle time the costs leave (unit costs
    placed them elsewhere: 35.5 against 34 for 1F1B + 2BP, 4 stages, 8 microbatches, costs 1, 2, 0.5).

    ``v`` stages per rank (``placement``): p v logical stages, each with the ratios of one chunk; a message
    crosses every boundary whose two stages are on different ranks (the simulator keeps a V placement's
    turn at rank p - 1 local)."""

    n = p * v
    costs = Costs(forward=(1.0,) * n, backward_input=(bi,) * n, backward_weight=(bw,) * n,
                  message_bytes=(msg,) * n, bandwidth=1.0)
    # ZB-H1 places its BWs by rule, not by costs. Several stages per rank: the rows the engine runs, built at
    # unit costs and free links, once per shape (ZB-V's greedy order is made for free messages: with slow
    # ones a rank would fill its memory cap with its first chunk's forwards while its second chunk's first
    # one is on its way).
    fixed = not split or schedule in ("myelin", "zb-h1") or v > 1
    chunks = {"virtual_stages": v, "placement": placement} if v > 1 else {}
    # The engine builds 1F1B* from unit costs and free links (runner.py): equal stages, one per group, which
    # these ratios' links would regroup; only where its weight passes go follows the costs.
    star = {"groups": tuple(range(p, 0, -1))} if schedule == "1f1b-star" else {}
    order = (_fixed_schedule(schedule, p, m, split, limit, v, placement) if fixed
             else make_schedule(schedule, p, m, split, costs=costs, **star, **chunks))
    core = run_order(order, costs)
    return max(r.end for r in core.records), memory_states(core, p, v)


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
                      limit: int = 0, v: int = 1, placement: str = "loop") -> tuple[float, tuple[tuple[tuple, ...], ...]]:
    """(makespan with F = 1, per-rank :func:`memory_states`); rank r runs stage r, or with ``v`` > 1 the
    stages ``placement`` gives it (F = 1 is then one chunk's forward).

    Up to :data:`MAX_SIMULATED` tasks, one run of the schedule simulator. Longer schedules: the makespan
    is extrapolated linearly in ``m`` from two simulated ones (:func:`_extrapolation_points`; the tests
    hold it to a full simulation), and each rank's
    memory from the closed forms: GPipe stashes all m, 1F1B min(m, p - rank), and with 2BP the weight
    residuals of all m, counted as if held with them (an upper bound); ZB-H1 1F1B's activations and
    ``rank + 1`` residuals (both its exact peaks, simulated at p up to 16). Myelin (Alg. 2) keeps at most its
    pipeline limit in flight on every stage, and its 2BP engine at most ``weight_budget`` (p) weight
    residuals (:mod:`~jaxhybrid.parallel.pipeline.message_driven`): both bounds, counted as if held together.

    ``limit``: Myelin's ``pipeline_limit`` (V-A; 0, the engine's default, is p), as a run sets it; the
    other schedules have none.

    Several stages per rank (interleaved 1F1B, ZB-V): the long schedule's memory is the later simulated
    point's states (their warm-up stashes do not grow with m: Narayanan et al. SC'21's interleaving keeps
    (v - 1) p more chunk activations than 1F1B whatever m; ZB-V caps them at 1F1B's), with interleaved 2BP's
    weight residuals bounded by all m per chunk (its weight passes wait for idle time, as 1F1B + 2BP's)."""
    limit = 0 if schedule != "myelin" or limit == p else limit  # one cache entry for the default
    m1, m2 = _extrapolation_points(schedule, p, m, limit)
    if p * v * m <= MAX_SIMULATED or m <= m2:
        return _simulate(schedule, p, m, split, bi, bw, msg, limit, v, placement)
    (t1, _), (t2, late) = (_simulate(schedule, p, k, split, bi, bw, msg, limit, v, placement) for k in (m1, m2))
    make = t2 + (m - m2) * (t2 - t1) / (m2 - m1)
    if v > 1:
        if split and schedule != "zb-v":
            late = tuple(tuple(sorted({(a, (m,) * v) for a, _ in st})) for st in late)
        return make, late
    if schedule == "myelin":  # a later stage may hold all in flight (p - rank is 1F1B's bound, not Alg. 2's)
        return make, tuple(((min(m, limit or p), min(m, p) if split else 0),) for _ in range(p))
    live = [m if schedule == "gpipe" else min(m, p - r) for r in range(p)]
    if schedule == "zb-h1":  # 1F1B's activations; stage r delays its BWs by r backward passes (r + 1 held)
        return make, tuple(((a, min(m, r + 1)),) for r, a in enumerate(live))
    return make, tuple(((a, m if split else 0),) for a in live)
