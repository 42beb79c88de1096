"""Checking a periodic pattern by unrolling it, and turning it into a per-rank :class:`Schedule`.

The check is independent of the ILP's constraints: it lays out ``batches`` batches in absolute time and
verifies dependencies, one operation at a time per processor and link, and the memory peak of every
processor by an event sweep (MadPipe Sec. 3: weights 3 W, buffers, stored activations ā per batch).
"""
from __future__ import annotations

from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.tasks import Schedule
from jaxhybrid.planner.chain import Chain, chain_ranks
from jaxhybrid.planner.ilp import Pattern, build_ops, processor_constants, stored_bytes

_TOL = 1e-9


def unroll(pattern: Pattern, batches: int) -> list[tuple[float, float, int, int]]:
    """(start, end, op index, batch) of every operation of ``batches`` batches, by start time.

    Batch b runs op o in period b + h_o; periods before the first are skipped by starting batch 0 at
    period h_o (equivalently, time is shifted so that the schedule starts at 0).
    """
    T = pattern.period
    out = []
    for b in range(batches):
        for i, o in enumerate(pattern.ops):
            s = (b + pattern.shift[i]) * T + pattern.start[i]
            out.append((s, s + o.duration, i, b))
    out.sort()
    return out


def validate_pattern(chain: Chain, pattern: Pattern, batches: int | None = None) -> dict:
    """Raise ValueError naming the first violation; return ``{"peak_memory": {proc: bytes}}``."""
    T = pattern.period
    stages = list(pattern.stages)
    ops, deps = build_ops(chain, stages)
    if [o.name for o in ops] != [o.name for o in pattern.ops]:
        raise ValueError("pattern operations do not match the allocation")
    for i, o in enumerate(ops):
        if not -_TOL * T <= pattern.start[i] < T or o.duration > T * (1 + 1e-7):
            raise ValueError(f"{o.name} starts at {pattern.start[i]:.6g} (duration {o.duration:.6g}), "
                             f"outside [0, T) or longer than T={T:.6g}")
    batches = batches or 3 * (max(pattern.shift) - min(pattern.shift) + 2)
    events = unroll(pattern, batches)
    when = {(i, b): (s, e) for s, e, i, b in events}
    for a, c in deps:
        for b in range(batches):
            if when[(c, b)][0] < when[(a, b)][1] - 1e-7 * T:
                raise ValueError(f"{ops[c].name} of batch {b} starts before {ops[a].name} of batch {b} ends")
    last_end: dict[tuple, tuple[float, str]] = {}
    for s, e, i, b in events:
        r = ops[i].resource
        if r in last_end and s < last_end[r][0] - 1e-7 * T:
            raise ValueError(f"{ops[i].name} (batch {b}) overlaps {last_end[r][1]} on {r}")
        last_end[r] = (max(e, last_end.get(r, (0.0, ""))[0]), f"{ops[i].name} (batch {b})")
    const = processor_constants(chain, stages)
    peaks = {}
    for q, c in const.items():
        sweep = []
        for s, e, i, b in events:
            o = ops[i]
            if o.resource == ("proc", q) and o.kind in ("F", "B"):
                w = stored_bytes(chain, stages[o.stage])
                # times on a 1e-9 T grid, so that an F starting exactly as a B ends sees the memory freed
                sweep.append((round(s / (T * 1e-9)), 1, w) if o.kind == "F" else (round(e / (T * 1e-9)), 0, -w))
        sweep.sort()  # at equal times frees (0) come before allocations (1)
        cur = peak = 0.0
        for _, _, w in sweep:
            cur += w
            peak = max(peak, cur)
        peaks[q] = c + peak
        if c + peak > chain.memory * (1 + 1e-9):
            raise ValueError(f"processor {q} needs {c + peak:.4g} bytes > memory {chain.memory:.4g}")
    return {"peak_memory": peaks}


def pattern_entries(pattern: Pattern) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The pattern as the engine runs it: ``pipeline.pattern`` (forward and backward passes by start time in
    the period, ``"F<stage>+<shift>"``; transfers are the messages between them) and ``pipeline.stage_to_rank``,
    with stages in chain order and processors numbered as they first appear along it (:func:`chain_ranks`)."""
    order = sorted(range(len(pattern.stages)), key=lambda i: pattern.stages[i].first)
    chain_index = {i: k for k, i in enumerate(order)}
    rank = chain_ranks(pattern.stages)
    base = min(pattern.shift)
    ops = sorted((pattern.start[i], i) for i, o in enumerate(pattern.ops) if o.kind in ("F", "B"))
    entries = tuple(f"{pattern.ops[i].kind}{chain_index[pattern.ops[i].stage]}+{pattern.shift[i] - base}"
                    for _, i in ops)
    return entries, tuple(rank[pattern.stages[i].processor] for i in order)


def pattern_to_schedule(pattern: Pattern, microbatches: int) -> Schedule:
    """The first ``microbatches`` batches of the pattern as the engine's ``periodic`` schedule (fused backward)."""
    entries, placed = pattern_entries(pattern)
    return make_schedule("periodic", max(placed) + 1, microbatches, stage_to_rank=placed, pattern=entries)
