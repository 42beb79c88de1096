"""MadPipe-DP (MadPipe Sec. 4.2.2): the best period of a chain for a target period T_hat, with one special
processor; Algorithm 1 (:func:`jaxhybrid.planner.madpipe.madpipe_partition`) searches T_hat over it.

T(l, p, t_P, m_P, V) is the best period of the first l layers on p normal processors when the special
processor already carries load t_P and memory m_P, and the delay between F_l and B_l of a batch is at
least V (Sec. 4.2.2). t_P, m_P and V live on grids (101 / 11 / 51 points by default, Sec. 5); values are
rounded up to the grid, so the DP never under-estimates a load or a memory. V's grid keeps Sec. 5's step,
(U(1, L) + sum C) / (v - 1), but runs on past that sum to the largest V any split reaches: (+) pads V to
a multiple of T_hat at each new group, so V exceeds the sum (by 10-75 % on the bench chains), and
cutting it there would shrink the groups g(k, l, V), hence the memory. The recurrence is evaluated
bottom-up in numpy: for each (p, l) all stage starts k and all grid points at once.

Two facts keep it fast: T(...) >= t_P, so the special branch's max(t'_P, ...) is the looked-up value; and
states with t_P above a known upper bound cannot improve the answer, so the t_P grid is cut there (the cut
is exact for Algorithm 1, which only compares the result with its bracket).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from jaxhybrid.planner.chain import Chain, Stage

_EPS = 1e-9


@dataclass(frozen=True)
class Grid:
    """Discretisation sizes of t_P, m_P and V (MadPipe Sec. 5 defaults)."""

    t: int = 101
    m: int = 11
    v: int = 51

    def __post_init__(self):
        if min(self.t, self.m, self.v) < 2:
            raise ValueError(f"grid sizes t={self.t}, m={self.m}, v={self.v} must be >= 2")


def _ceil_div(x, step):
    return np.ceil(np.asarray(x) / step - _EPS).astype(np.int64)


def _oplus(x, y, T):
    """x (+) y: stay in x's group if x + y fits in it, else start the next group (Sec. 4.2.2)."""
    gx = np.ceil(x / T - _EPS)
    same = np.ceil((x + y) / T - _EPS) == gx
    return np.where(same, x + y, T * gx + y)


class _DP:
    """Tables of one MadPipe-DP(T_hat) run, kept for the trace-back.

    ``tables[p, l]`` has shape (v, t + 1, m + 1): the last t and m entries are an ``inf`` border, so a
    special stage that pushes t_P or m_P off the grid reads ``inf`` through one flat ``np.take``.
    """

    def __init__(self, chain: Chain, processors: int, t_hat: float, grid: Grid, cap: float):
        self.ch, self.P, self.T, self.g, self.cap = chain, processors, t_hat, grid, cap
        U1L = float(chain.u.sum())
        self.dt = U1L / (grid.t - 1)
        self.dm = chain.memory / (grid.m - 1)
        self.dv = chain.total_period_bound() / (grid.v - 1)
        self.nt = min(grid.t, int(np.floor(cap / self.dt + _EPS)) + 1)  # t_P > cap is useless
        self.tg = np.arange(self.nt) * self.dt
        top = int(np.ceil(self.v_reach() / self.dv - _EPS))  # see module docstring
        self.vg = np.arange(max(grid.v, top + 1)) * self.dv
        # V rows kept: past max_l v_count(l) every layer l >= 1 is inf and layer 0 does not depend on V,
        # so a V' beyond is read at the last kept row (an inf row, or all V's fit and it is the grid's top).
        self.nv = min(len(self.vg), max(self.v_count(l) for l in range(1, chain.L + 1)) + 1)
        self.tables = np.full((processors, chain.L + 1, self.nv, self.nt + 1, grid.m + 1), np.inf,
                              dtype=np.float32)

    def v_reach(self) -> float:
        """The largest V' = (V (+) U(k, l)) (+) C(k - 1) over all splits into stages k_range allows: x (+) y
        is non-decreasing in x, so the largest V at each layer follows from the largest at the layers after."""
        vmax = np.full(self.ch.L + 1, -np.inf)
        vmax[self.ch.L] = 0.0
        for l in range(self.ch.L, 0, -1):
            k = self.k_range(l)
            if np.isfinite(vmax[l]) and len(k):
                v = _oplus(_oplus(vmax[l], self.ch.U(k, l), self.T), self.ch.C(k - 1), self.T)
                vmax[k - 1] = np.maximum(vmax[k - 1], v)
        return float(vmax[np.isfinite(vmax)].max())

    def k_range(self, l: int, p: int = 1) -> np.ndarray:
        """Stage starts worth trying: U(k, l) <= cap and weights + buffers M(k, l, 0) <= M; with no
        normal processor left (p = 0) only k = 1 (the base case: the special one takes layers 1..l)."""
        k = np.arange(1, l + 1) if p > 0 else np.arange(1, 2)
        ok = (self.ch.U(k, l) <= self.cap * (1 + _EPS)) & (self.ch.mem(k, l, 0) <= self.ch.memory)
        return k[ok]

    def v_count(self, l: int) -> int:
        """Grid points of V worth computing at layer l: beyond them no stage k..l fits even on the special
        processor (M(k, l, g(k, l, V) - 1), Sec. 4.2.1, the smallest memory of either branch); the table
        stays ``inf``. Every k counts: a longer stage can need less than l..l, whose 2 a_{l-1} buffer it
        does not pay."""
        k = self.k_range(l)
        grp = np.maximum(1, np.ceil((self.vg[None, :] + self.ch.U(k, l)[:, None]) / self.T - _EPS))
        fits = (self.ch.mem(k[:, None], l, grp - 1) <= self.ch.memory * (1 + _EPS)).any(axis=0)
        return int(fits.sum())  # memory grows with V for each k, so the fitting points are a prefix

    def stage_terms(self, l: int, k: np.ndarray, nv: int | None = None):
        """Per (k, v) quantities of a stage k..l: loads, groups, memories, V' and grid shifts."""
        ch, g = self.ch, self.g
        Ukl = ch.U(k, l)
        Ck = ch.C(k - 1)
        V = self.vg[None, :nv]
        grp = np.maximum(1, np.ceil((V + Ukl[:, None]) / self.T - _EPS))  # g(k, l, V)
        memN = ch.mem(k[:, None], l, grp)
        memS = ch.mem(k[:, None], l, grp - 1)
        Vp = _oplus(_oplus(V, Ukl[:, None], self.T), Ck[:, None], self.T)
        vpi = np.minimum(_ceil_div(Vp, self.dv), self.nv - 1)
        dti = np.minimum(_ceil_div(Ukl, self.dt), self.nt)
        dmi = np.minimum(_ceil_div(memS, self.dm), g.m)
        return Ukl, Ck, memN <= ch.memory * (1 + _EPS), vpi, dti, dmi

    def branches(self, l: int, p: int, k: np.ndarray, nv_l: int):
        """Candidate values (k, v, t, m), v < nv_l, of the normal and special branches for T(l, p, ...)."""
        Ukl, Ck, fitN, vpi, dti, dmi = self.stage_terms(l, k, nv_l)
        nt, nm, nv = self.nt, self.g.m, self.nv
        if p >= 1:
            prev = self.tables[p - 1][(k - 1)[:, None], vpi, :nt, :nm]  # T(k-1, p-1, t_P, m_P, V')
            base = np.maximum(Ukl, Ck).astype(np.float32)[:, None, None, None]
            normal = np.where(fitN[:, :, None, None], np.maximum(base, prev), np.float32(np.inf))
        else:
            normal = None
        # Special branch: T(k-1, p, t_P + U(k, l), m_P + M(k, l, g - 1), V'), read from the padded table.
        i32 = np.int32
        ti = np.minimum(np.arange(nt, dtype=i32)[None, :] + dti[:, None].astype(i32), nt)  # (k, t)
        mi = np.minimum(np.arange(nm, dtype=i32)[None, None, :] + dmi[:, :, None].astype(i32), nm)
        row = (((k - 1)[:, None] * nv + vpi) * ((nt + 1) * (nm + 1))).astype(i32)  # (k, v)
        idx = (row[:, :, None, None] + (ti * (nm + 1))[:, None, :, None] + mi[:, :, None, :])
        special = np.take(self.tables[p], idx)
        special = np.maximum(special, Ck.astype(np.float32)[:, None, None, None])
        if p == 0:  # no normal processor left: the special one takes layers 1..l as one stage
            special = np.where((k == 1)[:, None, None, None], special, np.float32(np.inf))
        return normal, special

    def run(self) -> float:
        tab, nt, nm = self.tables, self.nt, self.g.m
        for p in range(self.P):
            tab[p, 0, :, :nt, :nm] = self.tg[None, :, None]  # T(0, p, t_P, m_P, V) = t_P
            for l in range(1, self.ch.L + 1):
                k, nv_l = self.k_range(l, p), self.v_count(l)
                if len(k) == 0 or nv_l == 0:
                    continue
                normal, special = self.branches(l, p, k, nv_l)
                best = special.min(axis=0)
                if normal is not None:
                    best = np.minimum(best, normal.min(axis=0))
                tab[p, l, :nv_l, :nt, :nm] = best
        return float(tab[self.P - 1, self.ch.L, 0, 0, 0])

    def trace(self) -> list[Stage]:
        """Follow the argmin decisions from T(L, P-1, 0, 0, 0); normal stages get processors 0.., the
        special processor is P - 1."""
        l, p, v, t, m = self.ch.L, self.P - 1, 0, 0, 0
        out: list[tuple[int, int, bool]] = []
        while l > 0:
            k, nv_l = self.k_range(l, p), self.v_count(l)
            normal, special = self.branches(l, p, k, nv_l)
            _, _, _, vpi, dti, dmi = self.stage_terms(l, k, nv_l)
            s = special[:, v, t, m]
            i_s = int(s.argmin())
            n = normal[:, v, t, m] if normal is not None else np.full(len(k), np.inf)
            i_n = int(n.argmin())
            if n[i_n] <= s[i_s]:
                out.append((int(k[i_n]), l, False))
                l, p, v = int(k[i_n]) - 1, p - 1, int(vpi[i_n, v])
            else:
                out.append((int(k[i_s]), l, True))
                l, t, m, v = int(k[i_s]) - 1, t + int(dti[i_s]), m + int(dmi[i_s, v]), int(vpi[i_s, v])
        out.reverse()
        stages, nxt = [], 0
        for first, last, is_special in out:
            proc = self.P - 1 if is_special else nxt
            nxt += 0 if is_special else 1
            stages.append(Stage(first, last, proc))
        return stages


def madpipe_dp(chain: Chain, processors: int, t_hat: float, grid: Grid = Grid(),
               cap: float | None = None) -> tuple[float, list[Stage]]:
    """MadPipe-DP(T_hat): the best period under the memory estimates for target period ``t_hat``.

    Returns ``(period, stages)``; ``period`` is ``inf`` (and ``stages`` empty) when nothing fits or the
    period would exceed ``cap``.
    """
    if processors < 1:
        raise ValueError(f"processors={processors} must be >= 1")
    if not t_hat > 0:
        raise ValueError(f"t_hat={t_hat} must be > 0")
    cap = chain.total_period_bound() if cap is None else cap
    dp = _DP(chain, processors, t_hat, grid, cap)
    period = dp.run()
    if not np.isfinite(period) or period > cap * (1 + 1e-9):
        return float("inf"), []
    return period, dp.trace()


__all__ = ["Grid", "madpipe_dp"]


def grid_sizes(text: str):
    """argparse ``type=`` of MadPipe's grid sizes ``t,m,V`` (points of t_P, m_P and V; Sec. 5: 101,11,51),
    for ``partition`` and ``bench partition`` alike: exactly three, each >= 2."""
    parts = text.split(",")
    try:
        if len(parts) == 3:
            return Grid(*(int(x) for x in parts))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be three integers t,m,V >= 2 (the grid sizes of t_P, m_P and V), "
                                     f"got {text!r}")
