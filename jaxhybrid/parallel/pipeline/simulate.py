"""Discrete-event simulation of a schedule: makespan, bubble ratio, per-rank busy/idle and memory.

``simulate(schedule, costs)`` runs a static schedule's rows in order, each task as soon as its inputs
have arrived (:mod:`~jaxhybrid.parallel.pipeline.simcore`), or a message-driven schedule by Myelin's rule
(Algorithm 2, at most ``pipeline_limit`` microbatches in flight; BWs by the 2BP rule, at most
``weight_budget`` pending, as the engine's :mod:`~jaxhybrid.parallel.pipeline.message_driven` holds). The bubble
ratio is 2BP's: idle time over total runtime summed over all ranks, ``sum_r (makespan - busy_r) /
(ranks x makespan)``. Memory (2BP Sec. 4.2): a microbatch is stashed on a stage from the start of its F
until its B ends (fused) or its BW ends (2BP); bytes are ``activation_bytes`` from F until B/BI and
``residual_bytes`` from BI until BW. A rank holding several stages (virtual stages) counts each of them:
``peak_stashed`` is in (microbatch, stage) pairs, and ``peak_bytes`` weighs each by its stage's bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.policies import MessageDrivenPolicy
from jaxhybrid.parallel.pipeline.simcore import Core, Record, StaticPolicy, describe_deadlock
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule, Task
from jaxhybrid.parallel.pipeline.trace import Event, Timeline

__all__ = ["Costs", "RankStats", "SimResult", "simulate", "run_order", "memory_deltas"]


@dataclass(frozen=True)
class RankStats:
    busy: float
    idle: float
    peak_stashed: int
    peak_bytes: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated step costs. ``orders[r]`` is the order rank ``r`` actually ran (for a
    message-driven schedule it depends on the costs)."""

    schedule: str
    makespan: float
    bubble_ratio: float
    idle_total: float
    per_rank: tuple[RankStats, ...]
    timeline: Timeline
    orders: tuple[tuple[Task, ...], ...]

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
                "idle_total": self.idle_total, "per_rank": [asdict(r) for r in self.per_rank]}


def run_order(schedule: Schedule, costs: Costs, weight_budget: int = 0) -> Core:
    """Executes ``schedule`` under ``costs``; raises ValueError naming the blocked tasks on deadlock.
    ``weight_budget``: the engine's for message-driven 2BP (the event loop's policy,
    ``MessageDriven(weight_budget=...)``; 0: stages)."""
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"costs cover {costs.num_stages} stages, schedule {schedule.name!r} has "
                         f"{schedule.num_stages}")
    if schedule.policy == "message-driven":
        policy = MessageDrivenPolicy(schedule.rows, schedule.stage_to_rank,
                                     schedule.pipeline_limit or schedule.num_stages, weight_budget)
    elif schedule.policy == "static":
        policy = StaticPolicy(schedule.rows)
    else:
        raise ValueError(f"schedule policy {schedule.policy!r}: expected 'static' or 'message-driven'")
    core = Core(schedule.stage_to_rank, schedule.num_ranks, costs)
    stuck = core.run(policy)
    if stuck:
        raise ValueError(f"schedule {schedule.name!r} deadlocks: {describe_deadlock(core, policy, stuck)}")
    return core


def memory_deltas(records: list[Record]) -> list[tuple[float, int, int, int, int]]:
    """One rank's records as memory events (2BP Sec. 4.2), sorted, frees before allocations at equal
    times: ``(time, order, stage, activation delta, residual delta)`` in microbatches. A microbatch's
    activations live from the start of its F to the end of its B or BI, its weight residuals from the
    end of its BI to the end of its BW (which may take several microbatches)."""
    out = []
    for rec in records:
        t, s = rec.task, rec.task.stage
        if t.kind is Kind.F:
            out.append((rec.start, 1, s, 1, 0))
        elif t.kind is Kind.B:
            out.append((rec.end, 0, s, -1, 0))
        elif t.kind is Kind.BI:
            out.append((rec.end, 0, s, -1, 1))
        else:
            out.append((rec.end, 0, s, 0, -len(t.microbatches)))
    return sorted(out, key=lambda d: (d[0], d[1]))


def _memory(records: list[Record], costs: Costs) -> tuple[int, float]:
    """Peak stashed microbatches and bytes of one rank's records."""
    count = peak_count = 0
    nbytes = peak_bytes = 0.0
    for _, _, s, da, dr in memory_deltas(records):
        count, nbytes = count + da + dr, nbytes + da * costs.act_bytes(s) + dr * costs.resid_bytes(s)
        peak_count, peak_bytes = max(peak_count, count), max(peak_bytes, nbytes)
    return peak_count, peak_bytes


def _events(core: Core) -> list[Event]:
    evs, last_end = [], {}
    for rec in sorted(core.records, key=lambda r: (r.rank, r.start)):
        prev = last_end.get(rec.rank, 0.0)
        if rec.start > prev:
            evs.append(Event(rec.rank, "wait", "wait", prev, rec.start))
        t = rec.task
        evs.append(Event(rec.rank, str(t), t.kind.value, rec.start, rec.end, t.microbatches, t.stage))
        last_end[rec.rank] = rec.end
    for msg in core.messages:
        if msg.arrive > msg.send:
            kind, m, s = msg.key
            name = f"{'act' if kind == 'F' else 'grad'} {m} r{msg.src}->r{msg.dst}"
            evs.append(Event(msg.src, name, "send", msg.send, msg.arrive, (m,), s))
    return evs


def simulate(schedule: Schedule, costs: Costs | None = None, *, latency: float | None = None,
             bandwidth: float | None = None, weight_budget: int = 0) -> SimResult:
    """Simulates one step of ``schedule``.

    Args:
      schedule: from :func:`~jaxhybrid.parallel.pipeline.schedule.make_schedule` (or hand-written).
      costs: per-stage costs; default F = BI = BW = 1 (B = 2), unit activation bytes, free messages.
      latency, bandwidth: override ``costs.latency`` / ``costs.bandwidth``.
      weight_budget: message-driven 2BP: most microbatches whose weight pass may wait, as the engine's
        event loop's policy ``MessageDriven(weight_budget=...)`` (0: the number of stages, the engine's default).
    """
    costs = costs or Costs.uniform(schedule.num_stages)
    if latency is not None or bandwidth is not None:
        from dataclasses import replace
        costs = replace(costs, latency=costs.latency if latency is None else float(latency),
                        bandwidth=costs.bandwidth if bandwidth is None else float(bandwidth))
    core = run_order(schedule, costs, weight_budget)
    makespan = max((r.end for r in core.records), default=0.0)
    stats = []
    for rank in range(schedule.num_ranks):
        recs = [r for r in core.records if r.rank == rank]
        busy = sum(r.end - r.start for r in recs)
        peak, peak_bytes = _memory(recs, costs)
        stats.append(RankStats(busy, makespan - busy, peak, peak_bytes))
    idle = sum(s.idle for s in stats)
    total = makespan * schedule.num_ranks
    orders = tuple(tuple(r.task for r in sorted((x for x in core.records if x.rank == rank),
                                                key=lambda x: x.start)) for rank in range(schedule.num_ranks))
    return SimResult(schedule.name, makespan, idle / total if total else 0.0, idle, tuple(stats),
                     Timeline.of(_events(core), schedule.num_ranks), orders)
