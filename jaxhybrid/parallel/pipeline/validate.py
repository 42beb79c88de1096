"""Checks that a schedule can run: ``validate_schedule(schedule)`` raises ValueError naming the task.

In order: every task's stage exists and runs on the rank whose row holds it (the rank that holds the
stage in ``stage_to_rank``), microbatches are in range, backward kinds match ``split_backward``; every
input a task waits for is produced by some task (its producer exists), across ranks and across the
stages of one rank alike: F of stage s needs F of stage s-1, B/BI of stage s needs its own F and the
B/BI of stage s+1 (the last stage's only its F), BW needs its BI; every (microbatch, stage) has exactly
one F and one backward (B, or BI plus one BW covering it); a static row runs every task after the tasks
of its own rank it needs (with several stages per rank, the producing stage may be another of the rank's
chunks); simulating it with unit costs finishes (no deadlock); and, when ``max_stashed`` is given, no rank
stashes more microbatches (F started, B / BW not yet done) than its limit.
"""
from __future__ import annotations

from typing import Sequence

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.simcore import dependencies, products
from jaxhybrid.parallel.pipeline.simulate import run_order
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule, Task

_WHAT = {"F": "the output of F{m}@s{s}", "G": "the input gradient of the backward of microbatch {m} "
         "on stage {s}", "I": "BI{m}@s{s}"}


def _structure(sch: Schedule) -> None:
    if sch.num_microbatches < 1 or sch.num_stages < 1:
        raise ValueError(f"schedule {sch.name!r}: needs >= 1 stage and microbatch, got "
                         f"{sch.num_stages} stages and {sch.num_microbatches} microbatches")
    if any(not 0 <= r < sch.num_ranks for r in sch.stage_to_rank):
        raise ValueError(f"schedule {sch.name!r}: stage_to_rank {sch.stage_to_rank} names a rank "
                         f"outside 0..{sch.num_ranks - 1}")
    if sch.policy not in ("static", "message-driven"):
        raise ValueError(f"schedule {sch.name!r}: policy {sch.policy!r} is not 'static' or 'message-driven'")
    if sch.policy == "message-driven" and sch.pipeline_limit < 1:
        raise ValueError(f"message-driven schedule {sch.name!r} needs pipeline_limit >= 1, got "
                         f"{sch.pipeline_limit}")
    for r, row in enumerate(sch.rows):
        for t in row:
            if not 0 <= t.stage < sch.num_stages:
                raise ValueError(f"task {t} on rank {r}: stage {t.stage} is outside 0..{sch.num_stages - 1}")
            if sch.stage_to_rank[t.stage] != r:
                raise ValueError(f"task {t} is in rank {r}'s row, but stage {t.stage} runs on rank "
                                 f"{sch.stage_to_rank[t.stage]}")
            bad = [m for m in t.microbatches if not 0 <= m < sch.num_microbatches]
            if bad or not t.microbatches or len(set(t.microbatches)) != len(t.microbatches):
                raise ValueError(f"task {t} on rank {r}: microbatches {t.microbatches} must be distinct and "
                                 f"in 0..{sch.num_microbatches - 1}")
            if len(t.microbatches) > 1 and t.kind is not Kind.BW:
                raise ValueError(f"task {t} on rank {r}: only BW may cover several microbatches")
            split_kind = t.kind in (Kind.BI, Kind.BW)
            if sch.split_backward != split_kind and t.kind is not Kind.F:
                raise ValueError(f"task {t} on rank {r}: split_backward={sch.split_backward} allows "
                                 f"{'BI/BW' if sch.split_backward else 'fused B'} only")


def _coverage(sch: Schedule) -> None:
    where: dict[tuple, tuple[int, Task]] = {}
    for r, row in enumerate(sch.rows):
        for t in row:
            for key in products(t) + [("W", m, t.stage) for m in t.microbatches if t.kind is Kind.BW]:
                if key[0] == "I":
                    continue
                if key in where:
                    raise ValueError(f"task {t} on rank {r} repeats work already done by task "
                                     f"{where[key][1]} on rank {where[key][0]}")
                where[key] = (r, t)
    for r, row in enumerate(sch.rows):
        for t in row:
            for key in dependencies(t, sch.num_stages):
                produced = ("G" if key[0] == "I" else key[0], key[1], key[2]) in where
                if not produced:
                    raise ValueError(f"rank {r} task {t} waits for "
                                     f"{_WHAT[key[0]].format(m=key[1], s=key[2])}, which no rank runs")
    for s in range(sch.num_stages):
        for m in range(sch.num_microbatches):
            need = ["F", "G"] + (["W"] if sch.split_backward else [])
            for kind in need:
                if (kind, m, s) not in where:
                    what = {"F": "F", "G": "BI" if sch.split_backward else "B", "W": "BW"}[kind]
                    raise ValueError(f"schedule {sch.name!r}: no rank runs {what}{m}@s{s} "
                                     f"(rank {sch.stage_to_rank[s]} must)")


def _local_order(sch: Schedule) -> None:
    back = "BI" if sch.split_backward else "B"
    for r, row in enumerate(sch.rows):
        seen: set[tuple] = set()
        for t in row:
            for key in dependencies(t, sch.num_stages):
                # produced on this rank: its own stage, or another of its chunks (a neighbour stage it holds)
                if sch.stage_to_rank[key[2]] == r and key not in seen:
                    kind = {"F": "F", "G": back, "I": "BI"}[key[0]]
                    raise ValueError(f"task {t} on rank {r} comes before {kind}{key[1]}@s{key[2]}, which it needs")
            seen.update(products(t))


def stash_profile(order: Sequence[Task]) -> list[int]:
    """Stashed microbatches after each task of one rank's order (F: +1; B, or BW per microbatch: -1)."""
    out, n = [], 0
    for t in order:
        n += 1 if t.kind is Kind.F else -1 if t.kind is Kind.B else -len(t.microbatches) if \
            t.kind is Kind.BW else 0
        out.append(n)
    return out


def validate_schedule(schedule: Schedule, max_stashed: int | Sequence[int] | None = None,
                      costs: Costs | None = None) -> None:
    """Raises ValueError naming the offending task if ``schedule`` cannot run (see module docstring).

    Args:
      max_stashed: a per-rank (or common) limit on stashed microbatches; for a message-driven
        schedule the order simulated with ``costs`` is checked.
      costs: costs for the deadlock simulation (default: unit costs).
    """
    _structure(schedule)
    _coverage(schedule)
    if schedule.policy == "static":
        _local_order(schedule)
    core = run_order(schedule, costs or Costs.uniform(schedule.num_stages))
    if max_stashed is None:
        return
    limits = ([int(max_stashed)] * schedule.num_ranks if isinstance(max_stashed, int)
              else [int(x) for x in max_stashed])
    if len(limits) != schedule.num_ranks:
        raise ValueError(f"max_stashed has {len(limits)} entries for {schedule.num_ranks} ranks")
    for r in range(schedule.num_ranks):
        order = [rec.task for rec in sorted((x for x in core.records if x.rank == r), key=lambda x: x.start)]
        for t, n in zip(order, stash_profile(order)):
            if n > limits[r]:
                raise ValueError(f"rank {r} stashes {n} microbatches after task {t}, above its limit "
                                 f"{limits[r]}")


def peak_stashed(schedule: Schedule) -> list[int]:
    """Per-rank peak of :func:`stash_profile` over the rows (static schedules; timing-free)."""
    return [max(stash_profile(row), default=0) for row in schedule.rows]

