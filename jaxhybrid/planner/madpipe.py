"""MadPipe (MadPipe Sec. 4): its first phase, Algorithm 1 (Sec. 4.2), which brackets the target period
T_hat over MadPipe-DP (:mod:`jaxhybrid.planner.madpipe_dp`: one special processor), then the allocations
it met, scheduled (Sec. 4.3), against PipeDream's contiguous partition under 1F1B*.
"""
from __future__ import annotations

import numpy as np

from jaxhybrid.planner.chain import Chain, Stage
from jaxhybrid.planner.ilp import schedule_allocation
from jaxhybrid.planner.pattern import pattern_entries
from jaxhybrid.planner.madpipe_dp import Grid, madpipe_dp
from jaxhybrid.planner.pipedream import Allocation, one_f_one_b_star_period, pipedream, star_allocation_pattern


def madpipe_partition(chain: Chain, processors: int, iterations: int = 10, grid: Grid = Grid(),
                      upper: float | None = None) -> tuple[float, list[Stage], list[dict]]:
    """Algorithm 1: bracket T_hat* = argmin max(MadPipe-DP(T_hat), T_hat) by a modified bisection.

    Args:
      upper: a known achievable period (e.g. PipeDream + 1F1B*); it starts the bracket and cuts the DP.
      iterations: K, at most; the loop stops early once the bracket is narrower than the t_P grid step.

    Returns ``(best max(T_i, T_hat_i), stages, history)``.
    """
    lb = float(chain.u.sum()) / processors
    if not lb > 0:  # Algorithm 1 would start at T_hat = 0, which no DP can take
        raise ValueError(f"the chain's compute U(1, L) is {float(chain.u.sum())} s: every layer's forward_s and "
                         "backward_s are 0; MadPipe's period search needs some compute time")
    ub = chain.total_period_bound()
    step = float(chain.u.sum()) / (grid.t - 1)
    if upper is not None and np.isfinite(upper):
        ub = min(ub, upper + 2 * step)  # slack: grid rounding may cost the DP up to a step
    t_hat, best, best_stages, hist = lb, float("inf"), [], []
    for _ in range(iterations):
        # Cap the DP at 1.25 T_hat (and the bracket): a capped run still tells lb <- T_hat exactly, and
        # the DP's work shrinks with the cap (t_P grid and stage lengths).
        cap = min(ub, 1.25 * max(t_hat, lb))
        T_i, stages = madpipe_dp(chain, processors, t_hat, grid, cap=cap)
        T_i = max(T_i, cap) if not stages else T_i  # capped: we only know T_i >= cap
        tilde = max(T_i, t_hat)
        hist.append({"t_hat": t_hat, "dp_period": T_i, "tilde": tilde, "stages": stages})
        if stages and tilde < best:
            best, best_stages = tilde, stages
        lb = max(lb, min(T_i, t_hat))
        if stages:
            ub = min(ub, tilde)
        if ub - lb <= step:
            break
        # Until some allocation is found the bracket's top is the trivial bound; ramp T_hat up
        # geometrically instead, so the DP is not run with a huge cap (same monotone search).
        t_hat = (lb + ub) / 2 if best_stages else min(2 * t_hat, (lb + ub) / 2)
    return best, best_stages, hist


def madpipe(chain: Chain, processors: int, iterations: int = 10, grid: Grid = Grid(),
            ilp_time_limit: float = 2.0) -> Allocation:
    """MadPipe: Algorithm 1's allocation, then a valid periodic schedule for it (Sec. 4.3).

    Every distinct allocation met during Algorithm 1 is scheduled (the DP's estimate of the special
    processor's memory is a lower bound, so the best DP period is not always the best valid one), and so
    is PipeDream's contiguous partition under 1F1B*, which lies in MadPipe-DP's search space but may be
    lost to grid rounding. The allocation with the smallest valid period wins; ``note`` says which.
    """
    base = pipedream(chain, processors)
    best, stages, hist = madpipe_partition(chain, processors, iterations, grid, upper=base.valid_period)
    seen, cands = set(), []
    for h in hist:
        key = tuple((s.first, s.last, s.processor) for s in h["stages"])
        if h["stages"] and key not in seen:
            seen.add(key)
            cands.append((h["tilde"], h["stages"]))
    winner = Allocation("madpipe", (), float("inf"), float("inf"), "no allocation fits in memory")
    for dp_period, cand in sorted(cands, key=lambda c: c[0]):
        if len({s.processor for s in cand}) == len(cand):  # contiguous: 1F1B* is optimal (Prop. 1)
            valid = one_f_one_b_star_period(chain, cand)
            pattern = star_allocation_pattern(chain, cand, valid)
        else:
            pat = schedule_allocation(chain, cand, time_limit=ilp_time_limit)
            valid = pat.period if pat is not None else float("inf")
            pattern = pattern_entries(pat)[0] if pat is not None else ()
        if valid < winner.valid_period:
            winner = Allocation("madpipe", tuple(cand), dp_period, valid, "MadPipe-DP allocation", pattern)
    if base.valid_period < winner.valid_period:
        winner = Allocation("madpipe", base.stages, base.period, base.valid_period,
                            "PipeDream's contiguous partition under 1F1B* scheduled best", base.pattern)
    return winner


__all__ = ["Grid", "madpipe", "madpipe_dp", "madpipe_partition"]
