"""``jaxhybrid partition``: MadPipe or PipeDream (+ 1F1B*) partitioning of a profiled layer chain.

The chain comes from a profile JSON (``--profile FILE``) or from profiling a model's stage kernels on
this device (``--profile-model CFG``; with ``--profile FILE`` too, that profile is also written there to
reuse). Prints the stages (layer ranges, numbered from 0 as in the profile, and the processor of each), the
partitioning DP's period and the period of the valid schedule; ``--json`` prints
``{"algorithm", "period_s", "valid_period_s", "stages": [{"layers": [first, last], "processor": p}]}``.
"""
from __future__ import annotations

import argparse
import json
import math

from jaxhybrid.planner.chain import Chain, check_platform, check_processors
from jaxhybrid.planner.costs import load_profile
from jaxhybrid.planner.madpipe import Grid, madpipe
from jaxhybrid.planner.pipedream import pipedream


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="", metavar="FILE", help="profile JSON {input_bytes, layers: [...]} to "
                   "partition; with --profile-model, where the new profile is written (overwritten)")
    p.add_argument("--processors", type=int, required=True, help="P, number of GPUs")
    p.add_argument("--memory", type=float, required=True, help="M, bytes per GPU")
    p.add_argument("--bandwidth", type=float, required=True, help="beta, bytes/s between GPUs")
    p.add_argument("--algorithm", choices=("madpipe", "pipedream"), default="madpipe")
    p.add_argument("--grid", default="101,11,51", help="MadPipe grid sizes of t_P, m_P, V")
    p.add_argument("--iterations", type=int, default=10, help="K of MadPipe's Algorithm 1")
    p.add_argument("--profile-model", default="", metavar="CFG", help="instead of reading --profile, profile this "
                   "model preset's stage kernels on the current device (and write them to --profile if given)")
    p.add_argument("--microbatch-size", type=int, default=1, help="with --profile-model")
    p.add_argument("--seq-len", type=int, default=0, help="with --profile-model (default: max_seq_len)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --profile-model")
    p.add_argument("--json", action="store_true")


def result_json(alloc) -> dict:
    fin = (lambda x: x if math.isfinite(x) else None)
    return {"algorithm": alloc.algorithm, "period_s": fin(alloc.period), "valid_period_s": fin(alloc.valid_period),
            "stages": [{"layers": [s.first - 1, s.last - 1], "processor": s.processor} for s in alloc.stages],
            "note": alloc.note}


def smallest_fit(profile, args) -> str:
    """The smallest memory (bisection on PipeDream + 1F1B*, which is monotone enough) that fits."""
    def ok(m):
        return math.isfinite(pipedream(Chain.from_profile(profile, m, args.bandwidth), args.processors).valid_period)
    lo, hi = args.memory, args.memory * 2
    while not ok(hi):
        lo, hi = hi, hi * 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return f"about --memory={hi:.4g} bytes would fit with {args.processors} processors"


def _profile(args: argparse.Namespace):
    """The profile to partition; every argument is checked before a model is profiled (the slow part)."""
    if not args.profile_model:
        if not args.profile:
            raise ValueError("give --profile FILE (a profile JSON) or --profile-model CFG (profile a model "
                             "preset on this device)")
        profile = load_profile(args.profile)
        check_processors(args.processors, len(profile.layers), "--processors")
        return profile
    from jaxhybrid.model.config import resolve_model
    from jaxhybrid.planner.costs import save_profile
    from jaxhybrid.planner.profile import profile_model

    cfg = resolve_model(args.profile_model)
    check_processors(args.processors, cfg.n_layers, "--processors")  # one chain layer per block
    profile = profile_model(cfg, args.microbatch_size, args.seq_len or cfg.max_seq_len, args.dtype)
    if args.profile:
        save_profile(profile, args.profile)
    return profile


def run(args: argparse.Namespace) -> int:
    check_platform(args.memory, args.bandwidth, ("--memory", "--bandwidth"))
    if args.iterations < 1:
        raise ValueError(f"--iterations={args.iterations} must be >= 1")
    try:
        t, m, v = (int(x) for x in args.grid.split(","))
        grid = Grid(t, m, v)
    except ValueError as e:
        raise ValueError(f"--grid={args.grid!r} must be three integers t,m,V >= 2 ({e})") from None
    profile = _profile(args)
    chain = Chain.from_profile(profile, args.memory, args.bandwidth)
    if args.algorithm == "madpipe":
        alloc = madpipe(chain, args.processors, args.iterations, grid)
    else:
        alloc = pipedream(chain, args.processors)
    if not alloc.stages:
        raise ValueError(f"no partition of the {chain.L} layers fits in --memory={args.memory:.4g} bytes on "
                         f"{args.processors} processors; {smallest_fit(profile, args)}")
    out = result_json(alloc)
    if args.json:
        print(json.dumps(out))
        return 0
    note = f" ({alloc.note})" if alloc.note else ""
    print(f"{alloc.algorithm}: DP period {alloc.period:.6g} s, valid schedule period {alloc.valid_period:.6g} s{note}")
    for s in out["stages"]:
        print(f"  layers {s['layers'][0]:3d}-{s['layers'][1]:3d}  processor {s['processor']}")
    return 0
