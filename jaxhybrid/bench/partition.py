"""``jaxhybrid bench partition``: MadPipe vs PipeDream + 1F1B* on analytic layer chains (MadPipe Sec. 5).

Chains: a ResNet-50-like and a transformer-like network from :mod:`jaxhybrid.planner.costs` (images
1000 x 1000, batch 8). For each P, M and beta both algorithms run side by side; the JSON has the valid
periods, the DP periods, the solver wall times, and per memory the geometric mean over (P, beta) of
PipeDream's valid period over MadPipe's (> 1: MadPipe is faster), over cases both can schedule.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from jaxhybrid.core.argtypes import positive_int
from jaxhybrid.planner.chain import Chain
from jaxhybrid.planner.costs import resnet50_chain, transformer_chain
from jaxhybrid.planner.madpipe import madpipe
from jaxhybrid.planner.madpipe_dp import grid_sizes
from jaxhybrid.planner.pipedream import pipedream

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object (the default prints a table too)")
    p.add_argument("--quick", action="store_true", help="a small subset: P in {2, 4}, M in {4, 8} GB, beta 12")
    p.add_argument("--networks", default="resnet50,transformer", help="comma-separated: resnet50, transformer")
    p.add_argument("--grid", type=grid_sizes, default="101,11,51", help="t_P, m_P, V grid sizes")
    p.add_argument("--iterations", type=positive_int, default=10, help="K of Algorithm 1")


def _fmt(x: float):
    return None if not math.isfinite(x) else round(x, 6)


def run(args: argparse.Namespace) -> int:
    nets = {"resnet50": resnet50_chain, "transformer": transformer_chain}
    names = [n.strip() for n in args.networks.split(",") if n.strip()]
    bad = [n for n in names if n not in nets]
    if bad or not names:  # no network: no case, and the summary's max() of nothing
        what = f"unknown networks {bad}" if bad else f"--networks {args.networks!r} names no network"
        raise ValueError(f"{what}; choose from {', '.join(sorted(nets))}")
    grid = args.grid
    procs = (2, 4) if args.quick else tuple(range(2, 9))
    mems = (4, 8) if args.quick else (3, 4, 6, 8, 10, 12, 16)
    betas = (12,) if args.quick else (12, 24)
    cases, summary = [], {}
    for net in names:
        profile = nets[net]()
        for M in mems:
            ratios = []
            for P in procs:
                for beta in betas:
                    chain = Chain.from_profile(profile, M * GB, beta * GB)
                    t0 = time.perf_counter()
                    pd = pipedream(chain, P)
                    t1 = time.perf_counter()
                    mp = madpipe(chain, P, args.iterations, grid)
                    t2 = time.perf_counter()
                    if math.isfinite(pd.valid_period) and math.isfinite(mp.valid_period):
                        ratios.append(pd.valid_period / mp.valid_period)
                    cases.append({"network": net, "processors": P, "memory_gb": M, "beta_gbps": beta,
                                  "pipedream_period_s": _fmt(pd.period),
                                  "pipedream_valid_period_s": _fmt(pd.valid_period),
                                  "madpipe_period_s": _fmt(mp.period),
                                  "madpipe_valid_period_s": _fmt(mp.valid_period),
                                  "madpipe_stages": len(mp.stages), "madpipe_note": mp.note,
                                  "pipedream_wall_s": round(t1 - t0, 4), "madpipe_wall_s": round(t2 - t1, 3)})
                    c = cases[-1]  # progress: stdout for the table, stderr when stdout is the JSON
                    print(f"{net:12s} P={P} M={M:2d}GB beta={beta}GB/s  PD {c['pipedream_valid_period_s']}"
                          f"  MP {c['madpipe_valid_period_s']}  ({c['madpipe_wall_s']} s)", flush=True,
                          file=sys.stderr if args.json else sys.stdout)
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
            summary.setdefault(net, {})[str(M)] = {"geomean_pipedream_over_madpipe": gm and round(gm, 4),
                                                   "cases_both_valid": len(ratios)}
    out = {"bench": "partition", "grid": list(grid.__dict__.values()), "iterations": args.iterations,
           "cases": cases, "geomean_by_memory_gb": summary,
           "max_madpipe_wall_s": max(c["madpipe_wall_s"] for c in cases),
           "madpipe_worse_cases": sum(1 for c in cases if c["madpipe_valid_period_s"] is not None and
                                      c["pipedream_valid_period_s"] is not None and
                                      c["madpipe_valid_period_s"] > c["pipedream_valid_period_s"] * (1 + 1e-9)),
           "only_madpipe_valid": sum(1 for c in cases if c["madpipe_valid_period_s"] is not None and
                                     c["pipedream_valid_period_s"] is None)}
    print(json.dumps(out, indent=1 if not args.json else None))
    return 0
