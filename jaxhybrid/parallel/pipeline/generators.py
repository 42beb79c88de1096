"""Static per-rank task orders of the classic schedules (one logical stage per rank, stage ``s`` on rank
``s``) and of the schedules over several stages per rank (``stage_to_rank`` given: naive, GPipe and
Megatron-LM's interleaved 1F1B). Backward tasks are written with the kind given (``B`` fused, or ``BI`` for
2BP, whose ``BW`` are placed later by :class:`~jaxhybrid.parallel.pipeline.policies.FillPolicy`), except ZB-H1
which places its own BWs.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Sequence

from jaxhybrid.parallel.pipeline.tasks import Kind, Task, task

Rows = list[list[Task]]


def rank_stages(stage_to_rank: Sequence[int]) -> list[list[int]]:
    """The stages of each rank, lowest first (its chunks in order, for either placement)."""
    out: list[list[int]] = [[] for _ in range(max(stage_to_rank) + 1)]
    for s, r in enumerate(stage_to_rank):
        out[r].append(s)
    return out


def naive_rows(stages: int, microbatches: int, back: Kind, stage_to_rank: Sequence[int] | None = None) -> Rows:
    """2BP's naive schedule: no overlap between microbatches.

    Each microbatch goes forward through all stages and back before the next one starts (with one
    microbatch this is exactly 2BP's "no micro-batches" baseline of Table 1; more microbatches are
    gradient accumulation: the fused bubble ratio stays (N-1)/N, while with 2BP a rank runs BW k while
    microbatch k+1 travels, so the makespan is 2NM + 1 units instead of M(2N + 1)). With several stages
    per rank (``stage_to_rank``), a rank runs its stages' forwards upwards and their backwards downwards.
    """
    owned = rank_stages(stage_to_rank or range(stages))
    return [[t for m in range(microbatches) for t in [task("F", m, s) for s in mine]
             + [task(back, m, s) for s in reversed(mine)]] for mine in owned]


def gpipe_rows(stages: int, microbatches: int, back: Kind, stage_to_rank: Sequence[int] | None = None) -> Rows:
    """GPipe: all forwards, then all backwards in microbatch order (2BP Fig. 1). With several stages per
    rank (``stage_to_rank``), the forwards go stage by stage upwards and the backwards downwards: a
    rank's later stage needs the same microbatch's way through the other ranks first."""
    owned = rank_stages(stage_to_rank or range(stages))
    return [[task("F", m, s) for s in mine for m in range(microbatches)]
            + [task(back, m, s) for s in reversed(mine) for m in range(microbatches)] for mine in owned]


def _warmup_then_pairs(total: int, warmup: int, forward: Callable[[int], Task],
                       backward: Callable[[int], Task]) -> list[Task]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards (1F1B's three phases
    over ``total`` forwards and backwards, numbered in their order)."""
    w = min(warmup, total)
    row = [forward(k) for k in range(w)]
    for i in range(total - w):
        row += [forward(w + i), backward(i)]
    return row + [backward(k) for k in range(total - w, total)]


def one_f_one_b_row(stage: int, microbatches: int, warmup: int, back: Kind) -> list[Task]:
    """1F1B on one stage: ``warmup`` forwards, then F/B pairs, then the remaining backwards.

    With ``warmup = g - 1`` this is also the order of MadPipe's periodic 1F1B* pattern on a stage of
    group ``g`` (Sec. 4.1: F on microbatch ``i`` is followed by B on microbatch ``i - g + 1``).
    """
    return _warmup_then_pairs(microbatches, warmup, lambda m: task("F", m, stage), lambda m: task(back, m, stage))


def one_f_one_b_rows(stages: int, microbatches: int, back: Kind) -> Rows:
    """1F1B (PipeDream-Flush): stage ``s`` warms up with ``P - 1 - s`` forwards, so it stashes at most
    ``P - s`` microbatches."""
    return [one_f_one_b_row(s, microbatches, stages - 1 - s, back) for s in range(stages)]


def zb_h1_rows(stages: int, microbatches: int) -> Rows:
    """ZB-H1 (Qi et al. 2024, zero bubble with 1F1B's peak memory): the F/BI order of 1F1B, with the
    weight gradients of stage ``s`` delayed by ``s`` backward passes, so that stage ``s`` holds at most
    ``P`` microbatches (like stage 0 of 1F1B) and the idle time of every stage is ZB's
    ``(P - 1)(F + BI - BW)`` whenever ``BW <= F`` (ZB's handcrafted schedules assume equal F, B, W).
    With ``BW > F`` a delayed BW overruns the slot of a forward and the idle time is larger.
    """
    rows = []
    for s in range(stages):
        row, done_bi, done_bw = [], 0, 0
        for t in one_f_one_b_row(s, microbatches, stages - 1 - s, Kind.BI):
            row.append(t)
            if t.kind is Kind.BI:
                done_bi += 1
                if done_bi - done_bw > s:
                    row.append(task("BW", done_bw, s))
                    done_bw += 1
        row += [task("BW", m, s) for m in range(done_bw, microbatches)]
        rows.append(row)
    return rows


def interleaved_1f1b_rows(ranks: int, chunks: int, microbatches: int, back: Kind) -> Rows:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, Sec. 2.2 and Fig. 4) with the loop placement:
    rank ``r`` holds stages ``r, r + p, ..., r + (v-1) p`` (its chunks ``c = 0..v-1``).

    Rank ``r`` runs ``v m`` "virtual microbatches" ``k``: forward ``k`` is chunk ``(k // p) % v`` of
    microbatch ``(k // (p v)) p + k % p`` (a group of ``p`` microbatches through one chunk, then the next
    chunk), backward ``k`` the same with the chunk reversed; ``(p - r - 1) 2 + (v - 1) p`` warm-up forwards
    (Megatron's ``num_warmup_microbatches``: the factor 2 is the round trip back to this rank), then 1F1B,
    then the remaining backwards. Needs ``m`` a multiple of ``p`` (the caller checks it). With ``v = 1``
    the warm-up is plain 1F1B's ``p - r - 1`` and the rows are 1F1B's.
    """
    def unit(r: int, k: int, forward: bool) -> Task:
        c = (k // ranks) % chunks
        mb = (k // (ranks * chunks)) * ranks + k % ranks
        stage = (c if forward else chunks - 1 - c) * ranks + r
        return task("F", mb, stage) if forward else task(back, mb, stage)

    rows = []
    for r in range(ranks):
        warmup = ranks - r - 1 if chunks == 1 else (ranks - r - 1) * 2 + (chunks - 1) * ranks
        rows.append(_warmup_then_pairs(chunks * microbatches, warmup, lambda k, r=r: unit(r, k, True),
                                       lambda k, r=r: unit(r, k, False)))
    return rows


def resource_groups(loads: Sequence[float], period: float) -> list[int]:
    """MadPipe Sec. 4.1's rule over a chain of resources (stages, or stages and links interleaved): from the
    last resource backwards, add resources to the current group while its total load stays ``<= period``
    (a relative slack of 1e-12 absorbs float sums); the group number of each resource (1: the last one's).
    Raises ValueError if one resource alone exceeds the period."""
    if max(loads) > period * (1 + 1e-12):
        raise ValueError(f"period {period:.6g} is below the largest stage or link load {max(loads):.6g}")
    groups, g, acc = [0] * len(loads), 1, 0.0
    for i in range(len(loads) - 1, -1, -1):
        if acc + loads[i] > period * (1 + 1e-12):
            g, acc = g + 1, 0.0
        acc += loads[i]
        groups[i] = g
    return groups


def madpipe_groups(stage_costs: Sequence[tuple[float, float]], period: float,
                   links: Sequence[float] | None = None) -> tuple[int, ...]:
    """MadPipe Sec. 4.1 grouping of stages with loads ``U(s) = U_F(s) + U_B(s)``; returns the group number
    ``g`` of each stage (group 1 holds the last stage). A stage of group ``g`` stores exactly ``g``
    activations. ``links``: the load of each boundary between stages (its activation forward and gradient
    back), resources of their own between the stages (a P-stage partition is 2P - 1 resources); none: free.
    """
    loads = [float(f) + float(b) for f, b in stage_costs]
    if not math.isfinite(period):  # NaN compares false with every load, and inf groups every stage as one
        raise ValueError(f"1F1B* period {period} must be a finite number >= {max(loads)} (the largest stage "
                         f"load U = F + B)")
    if period < max(loads):
        worst = max(range(len(loads)), key=loads.__getitem__)
        raise ValueError(f"1F1B* period {period} is below the load U = F + B = {loads[worst]} of stage "
                         f"{worst}; use a period >= {max(loads)}")
    links = [0.0] * (len(loads) - 1) if links is None else [float(c) for c in links]
    if len(links) != len(loads) - 1:
        raise ValueError(f"{len(links)} link loads for {len(loads)} stages; need one per boundary")
    chain = [x for s, u in enumerate(loads) for x in ([u] if s == 0 else [links[s - 1], u])]
    return tuple(resource_groups(chain, period)[::2])


def check_groups(groups: Sequence[int], stages: int) -> tuple[int, ...]:
    """Validates explicit group numbers: last stage in group 1, non-increasing by steps of 0 or 1."""
    g = tuple(int(x) for x in groups)
    ok = len(g) == stages and g[-1] == 1 and all(a - b in (0, 1) for a, b in zip(g, g[1:]))
    if not ok:
        raise ValueError(f"1F1B* groups {g} for {stages} stages: need one per stage, the last one 1, "
                         "each stage's group equal to or one more than the next stage's (MadPipe 4.1)")
    return g


def one_f_one_b_star_rows(groups: Sequence[int], microbatches: int, back: Kind) -> Rows:
    """MadPipe's 1F1B* for a contiguous partition: stage ``s`` of group ``g_s`` runs 1F1B with
    ``g_s - 1`` warm-up forwards, the order of the periodic pattern; it stashes ``min(g_s, M)``."""
    return [one_f_one_b_row(s, microbatches, g - 1, back) for s, g in enumerate(groups)]


def parse_pattern(pattern: Sequence[str], stages: int) -> list[tuple[str, int, int]]:
    """``(kind, stage, shift)`` of each entry of a periodic pattern written ``"F<stage>+<shift>"`` or
    ``"B<stage>+<shift>"`` (MadPipe Sec. 3: batch ``b`` runs the operation in period ``b + shift``), one
    period's forward and backward passes in the order they start. Every stage needs exactly one of each."""
    ops, seen = [], set()
    for i, text in enumerate(pattern):
        m = re.fullmatch(r"([FB])(\d+)\+(\d+)", str(text).strip())
        if not m:
            raise ValueError(f"pattern entry {i} {text!r} is not F<stage>+<shift> or B<stage>+<shift> "
                             f"(e.g. F0+0, B2+1)")
        kind, stage, shift = m.group(1), int(m.group(2)), int(m.group(3))
        if stage >= stages:
            raise ValueError(f"pattern entry {i} {text!r} names stage {stage}; the pipeline has stages 0..{stages - 1}")
        if (kind, stage) in seen:
            raise ValueError(f"pattern entry {i} {text!r} repeats the {kind} pass of stage {stage}: one period "
                             f"runs each pass once")
        seen.add((kind, stage))
        ops.append((kind, stage, shift))
    missing = [f"{k}{s}" for s in range(stages) for k in "FB" if (k, s) not in seen]
    if missing:
        raise ValueError(f"the pattern has no {', '.join(missing)}: one period runs the forward and the backward "
                         f"of each of the {stages} stages")
    return ops


def periodic_rows(ops: Sequence[tuple[str, int, int]], stage_to_rank: Sequence[int], microbatches: int,
                  back: Kind) -> Rows:
    """A periodic pattern unrolled over ``microbatches`` (MadPipe Sec. 3 and 4.3): period ``k`` runs, in the
    pattern's order, each operation's batch ``k - shift``, where that batch exists. A batch's operations
    keep the order they have in the infinite schedule, so the finite one inherits its dependencies; a
    rank's row is the operations of its stages."""
    lo, hi = min(s for *_, s in ops), max(s for *_, s in ops)
    rows: Rows = [[] for _ in range(max(stage_to_rank) + 1)]
    for k in range(lo, microbatches + hi):
        for kind, stage, shift in ops:
            if 0 <= k - shift < microbatches:
                rows[stage_to_rank[stage]].append(task("F" if kind == "F" else back, k - shift, stage))
    return rows


def star_pattern(groups: Sequence[int]) -> tuple[str, ...]:
    """MadPipe's 1F1B* (Sec. 4.1) as a periodic pattern: a stage of group ``g`` runs its forward of batch
    ``i`` and then the backward of batch ``i - g + 1`` in each period (it stores ``g`` batches)."""
    return tuple(x for s, g in enumerate(groups) for x in (f"F{s}+0", f"B{s}+{g - 1}"))
