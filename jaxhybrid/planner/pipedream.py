"""Contiguous allocations: the 1F1B* schedule (MadPipe Sec. 4.1) and PipeDream's partitioning DP.

1F1B*: with communications as extra "layers" (a P-stage partition becomes 2P - 1 resources), groups are
built from the last resource backwards while their total load fits in the period T; a stage of group g
stores g activations of each of its layers. Proposition 1: no periodic pattern of period T stores fewer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxhybrid.parallel.pipeline.generators import resource_groups, star_pattern
from jaxhybrid.planner.chain import Chain, Stage, check_processors


def _items(chain: Chain, stages: list[Stage]) -> list[float]:
    """Loads of the 2N - 1 resources of a contiguous partition: stage, link, stage, ..., stage."""
    out = []
    for i, s in enumerate(stages):
        out.append(float(chain.U(s.first, s.last)))
        if i + 1 < len(stages):
            out.append(float(chain.C(s.last)))
    return out


def group_numbers(loads: list[float], period: float) -> list[int]:
    """1F1B* groups of the resources (1 = the group of the last stage): MadPipe Sec. 4.1's rule."""
    return resource_groups(loads, period)


def stage_groups(chain: Chain, stages: list[Stage], period: float) -> list[int]:
    """Group number g of each stage under 1F1B* at ``period`` (its stored activations per layer)."""
    return group_numbers(_items(chain, stages), period)[::2]


def stage_memory(chain: Chain, stages: list[Stage], groups: list[int]) -> list[float]:
    return [float(chain.mem(s.first, s.last, g)) for s, g in zip(stages, groups)]


def one_f_one_b_star_period(chain: Chain, stages: list[Stage]) -> float:
    """Smallest period whose 1F1B* pattern fits every stage in memory; ``inf`` if none does.

    Groups (hence memory) only change where the period crosses a sum of consecutive resource loads, and
    they are non-increasing in the period, so the answer is the smallest such sum (>= the largest load)
    that fits.
    """
    loads = _items(chain, stages)
    prefix = np.concatenate([[0.0], np.cumsum(loads)])
    sums = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(len(prefix), 1)])
    cands = sums[sums >= max(loads)]
    lo, hi = 0, len(cands)  # binary search on the monotone predicate "fits"

    def fits(t):
        return max(stage_memory(chain, stages, stage_groups(chain, stages, t))) <= chain.memory

    if not fits(cands[-1]):
        return float("inf")
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(cands[lo])


@dataclass(frozen=True)
class Allocation:
    """A partition into stages with processors, the DP's period and (when scheduled) the valid period."""

    algorithm: str
    stages: tuple[Stage, ...]
    period: float  # what the partitioning DP predicts
    valid_period: float  # period of a valid schedule (1F1B* or the ILP); inf if none fits in memory
    note: str = ""
    # That schedule as a periodic pattern over the stages in chain order ("F<stage>+<shift>", the engine's
    # pipeline.pattern): 1F1B*'s groups, or the ILP's pattern; empty if none fits.
    pattern: tuple[str, ...] = ()


def pipedream_dp(chain: Chain, processors: int) -> tuple[float, list[Stage]]:
    """PipeDream's contiguous partitioning (straight pipelines, no replication) with its memory estimate.

    D[j][k] is the best period for layers k..L cut into j stages, the stage starting at k holding j
    activations (1F1B keeps N - rank); communications are link loads C(l). Vectorised over (k, l).
    PipeDream ignores that links also delay backward passes, which is why its partitions can need up to
    2P - 1 activations under a valid schedule (MadPipe Sec. 5).
    """
    L = chain.L
    k = np.arange(1, L + 1)[:, None]
    l = np.arange(1, L + 1)[None, :]
    valid = l >= k
    kk, ll = np.broadcast_arrays(k, l)
    kk, ll = np.where(valid, kk, 1), np.where(valid, ll, 1)
    U = np.where(valid, chain.U(kk, ll), np.inf)
    C = chain.C(np.arange(1, L + 1))
    D = np.full((processors + 1, L + 2), np.inf)
    choice = np.zeros((processors + 1, L + 2), dtype=int)
    fit1 = valid[:, -1] & (chain.mem(np.arange(1, L + 1), L, 1) <= chain.memory)
    D[1, 1:L + 1] = np.where(fit1, U[:, -1], np.inf)
    choice[1, 1:L + 1] = L
    for j in range(2, processors + 1):
        fits = valid & (l < L) & (chain.mem(kk, ll, j) <= chain.memory)
        nxt = np.concatenate([D[j - 1, 2:L + 1], [np.inf]])[None, :]  # D[j-1][l+1]
        val = np.where(fits, np.maximum(np.maximum(U, C[None, :]), nxt), np.inf)
        best = val.argmin(axis=1)
        D[j, 1:L + 1] = val[np.arange(L), best]
        choice[j, 1:L + 1] = best + 1
    j = int(np.argmin(D[1:, 1])) + 1
    if not np.isfinite(D[j, 1]):
        return float("inf"), []
    stages, first = [], 1
    for p in range(j):
        last = int(choice[j - p, first])
        stages.append(Stage(first, last, p))
        first = last + 1
    return float(D[j, 1]), stages


def pipedream(chain: Chain, processors: int) -> Allocation:
    """PipeDream's partition, made valid with 1F1B* (the baseline of MadPipe Sec. 5).

    Raises ValueError for more processors than layers; :func:`~jaxhybrid.planner.madpipe.madpipe` starts
    here, so it refuses them the same way."""
    check_processors(processors, chain.L)
    period, stages = pipedream_dp(chain, processors)
    if not stages:
        return Allocation("pipedream", (), float("inf"), float("inf"), "no contiguous partition fits")
    valid = one_f_one_b_star_period(chain, stages)
    return Allocation("pipedream", tuple(stages), period, valid, pattern=star_allocation_pattern(chain, stages, valid))


def star_allocation_pattern(chain: Chain, stages: list[Stage], period: float) -> tuple[str, ...]:
    """1F1B*'s pattern (MadPipe Sec. 4.1) of a contiguous partition at ``period``; empty if it is infinite."""
    if not np.isfinite(period):
        return ()
    return star_pattern(stage_groups(chain, sorted(stages, key=lambda s: s.first), period))
