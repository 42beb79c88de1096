"""MadPipe's second phase (Sec. 4.3): a valid periodic pattern for a fixed allocation, by an ILP (HiGHS).

For a period T, every operation o (forward F_s and backward B_s of each stage, and the activation and
gradient transfers between stages on different processors) gets a start time t_o in [0, T) and an
integer index shift h_o (batch b runs o in period b + h_o, MadPipe Sec. 3). Constraints:

* dependencies of one batch: t_b + T h_b >= t_a + d_a + T h_a;
* one operation at a time per processor and per link: a binary y_ab orders each pair in the period;
* memory, exactly: a stage s stores ā_s = sum of a_{i-1} over its layers per active batch, and holds
  h_B - h_F + [F_s started] - [B_s finished] batches at any instant; the peak on a processor is reached
  when some F starts, where those indicators are the ordering binaries. Weights (3 W) and transfer
  buffers (2 a per boundary, MadPipe Sec. 3) are constants.

The smallest feasible T is found by a geometric then bisection search from the load lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxhybrid.planner.chain import Chain, Stage


@dataclass(frozen=True)
class Op:
    name: str  # "F3", "B3", "cF3" (activation after stage 3), "cB3" (its gradient)
    kind: str  # F | B | cF | cB
    stage: int  # 0-based stage index (for transfers: the stage before the boundary)
    resource: tuple  # ("proc", q) or ("link", q1, q2)
    duration: float


@dataclass(frozen=True)
class Pattern:
    """A periodic pattern: op -> (start in [0, T), index shift)."""

    period: float
    ops: tuple[Op, ...]
    start: tuple[float, ...]
    shift: tuple[int, ...]
    stages: tuple[Stage, ...]


def build_ops(chain: Chain, stages: list[Stage]) -> tuple[list[Op], list[tuple[int, int]]]:
    """Operations and same-batch dependencies (index pairs a -> b) of an allocation."""
    ops: list[Op] = []
    deps: list[tuple[int, int]] = []
    F, B = {}, {}
    for i, s in enumerate(stages):
        uF = float(chain.uF[s.first:s.last + 1].sum())
        u = float(chain.U(s.first, s.last))
        F[i] = len(ops)
        ops.append(Op(f"F{i}", "F", i, ("proc", s.processor), uF))
        B[i] = len(ops)
        ops.append(Op(f"B{i}", "B", i, ("proc", s.processor), u - uF))
    for i in range(len(stages) - 1):
        p, q = stages[i].processor, stages[i + 1].processor
        if p == q:
            deps += [(F[i], F[i + 1]), (B[i + 1], B[i])]
            continue
        d = float(chain.a[stages[i].last]) / chain.bandwidth
        link = ("link", min(p, q), max(p, q))
        cf, cb = len(ops), len(ops) + 1
        ops += [Op(f"cF{i}", "cF", i, link, d), Op(f"cB{i}", "cB", i, link, d)]
        deps += [(F[i], cf), (cf, F[i + 1]), (B[i + 1], cb), (cb, B[i])]
    deps.append((F[len(stages) - 1], B[len(stages) - 1]))
    return ops, deps


def processor_constants(chain: Chain, stages: list[Stage]) -> dict[int, float]:
    """Weights (3 W) and transfer buffers (2 a on both sides of a cross-processor boundary)."""
    const: dict[int, float] = {}
    for i, s in enumerate(stages):
        c = 3 * float(chain.W[s.first:s.last + 1].sum())
        if i > 0 and stages[i - 1].processor != s.processor:
            c += 2 * float(chain.a[s.first - 1])
        if i + 1 < len(stages) and stages[i + 1].processor != s.processor:
            c += 2 * float(chain.a[s.last])
        const[s.processor] = const.get(s.processor, 0.0) + c
    return const


def stored_bytes(chain: Chain, s: Stage) -> float:
    """ā_s = sum of a_{i-1} over the stage's layers (MadPipe Sec. 4.3), or of the profile's stored bytes."""
    return float(chain.stored[s.first:s.last + 1].sum())


def solve_pattern(chain: Chain, stages: list[Stage], period: float, time_limit: float = 5.0) -> Pattern | None:
    """One ILP: a valid pattern of exactly ``period``, or None if HiGHS proves (or finds) none in time."""
    ops, deps = build_ops(chain, stages)
    n = len(ops)
    if max(o.duration for o in ops) > period:
        return None
    H = 2 * n + 2
    by_res: dict[tuple, list[int]] = {}
    for i, o in enumerate(ops):
        by_res.setdefault(o.resource, []).append(i)
    pairs = [(a, b) for idx in by_res.values() for x, a in enumerate(idx) for b in idx[x + 1:]]
    pair_ix = {p: 2 * n + j for j, p in enumerate(pairs)}
    nv = 2 * n + len(pairs)  # t_0..t_{n-1}, h_0..h_{n-1}, y_pairs
    rows, lo, hi = [], [], []

    def add(coeffs: dict[int, float], lower=-np.inf, upper=np.inf):
        r = np.zeros(nv)
        for k, v in coeffs.items():
            r[k] += v
        rows.append(r)
        lo.append(lower)
        hi.append(upper)

    T = period
    for a, b in deps:  # t_b + T h_b - t_a - T h_a >= d_a
        add({b: 1, n + b: T, a: -1, n + a: -T}, lower=ops[a].duration)

    def before(a, b):
        """{var: coeff}, const such that the expression equals 1 iff a runs before b in the period."""
        if (a, b) in pair_ix:
            return {pair_ix[(a, b)]: 1.0}, 0.0
        return {pair_ix[(b, a)]: -1.0}, 1.0

    for (a, b), y in pair_ix.items():  # a before b if y = 1, else b before a
        add({a: 1, b: -1, y: T}, upper=T - ops[a].duration)
        add({b: 1, a: -1, y: -T}, upper=-ops[b].duration)
    const = processor_constants(chain, stages)
    F = {o.stage: i for i, o in enumerate(ops) if o.kind == "F"}
    Bi = {o.stage: i for i, o in enumerate(ops) if o.kind == "B"}
    for q, c in const.items():
        on_q = [i for i, s in enumerate(stages) if s.processor == q]
        for s0 in on_q:  # memory just after F_{s0} starts
            coeffs: dict[int, float] = {}
            rhs = chain.memory - c
            for s in on_q:
                w = stored_bytes(chain, stages[s])
                coeffs[n + Bi[s]] = coeffs.get(n + Bi[s], 0.0) + w
                coeffs[n + F[s]] = coeffs.get(n + F[s], 0.0) - w
                terms = [(before(Bi[s], F[s0]), -w)]
                if s == s0:
                    rhs -= w
                else:
                    terms.append((before(F[s], F[s0]), w))
                for (cf, k0), sign in terms:
                    rhs -= sign * k0
                    for k, v in cf.items():
                        coeffs[k] = coeffs.get(k, 0.0) + sign * v
            add(coeffs, upper=rhs)
    lb = np.zeros(nv)
    # Starts in [0, T): an operation may wrap into the next period (as 1F1B* patterns do); the pair
    # constraints above are the cyclic ones, and the memory rows then over-count by at most one batch.
    ub = np.concatenate([np.full(n, T * (1 - 1e-9)), np.full(n, H), np.ones(len(pairs))])
    ub[n + F[0]] = 0  # the shift of F_1 is 0 by convention
    integrality = np.concatenate([np.zeros(n), np.ones(n + len(pairs))])
    cost = np.concatenate([np.zeros(n), np.ones(n), np.zeros(len(pairs))])
    res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(lb, ub), options={"time_limit": time_limit, "presolve": True})
    if res.x is None:
        return None
    x = res.x
    return Pattern(T, tuple(ops), tuple(float(v) for v in x[:n]), tuple(int(round(v)) for v in x[n:2 * n]),
                   tuple(stages))


def load_bound(chain: Chain, stages: list[Stage]) -> float:
    """Largest load of a processor or link: no pattern can have a shorter period."""
    ops, _ = build_ops(chain, stages)
    loads: dict[tuple, float] = {}
    for o in ops:
        loads[o.resource] = loads.get(o.resource, 0.0) + o.duration
    return max(loads.values())


def schedule_allocation(chain: Chain, stages: list[Stage], rel_tol: float = 0.01, time_limit: float = 2.0,
                        max_factor: float = 8.0) -> Pattern | None:
    """The smallest period (within ``rel_tol``) of a valid pattern for the allocation; None if even
    ``max_factor`` times the load bound does not fit in memory."""
    lo_T = load_bound(chain, stages)
    const = processor_constants(chain, stages)
    for q, c in const.items():  # at any period, a processor holds its weights and one batch of a stage
        need = c + max(stored_bytes(chain, s) for s in stages if s.processor == q)
        if need > chain.memory:
            return None
    pat = solve_pattern(chain, stages, lo_T, time_limit)
    if pat is not None:
        return pat
    if solve_pattern(chain, stages, max_factor * lo_T, time_limit) is None:  # one ILP rules out the rest
        return None
    hi_T = lo_T
    while pat is None:
        lo_T, hi_T = hi_T, min(hi_T * 1.25, max_factor * load_bound(chain, stages))
        pat = solve_pattern(chain, stages, hi_T, time_limit)
    while hi_T - lo_T > rel_tol * hi_T:
        mid = (lo_T + hi_T) / 2
        cand = solve_pattern(chain, stages, mid, time_limit)
        if cand is None:
            lo_T = mid
        else:
            hi_T, pat = mid, cand
    return pat
