"""``jaxhybrid partition``: MadPipe or PipeDream (+ 1F1B*) partitioning of a profiled layer chain.

The chain comes from a profile JSON (``--profile FILE``) or from profiling a model's stage kernels on
this device (``--profile-model CFG``, a preset or a run config as ``plan --model`` takes; with ``--profile
FILE`` too, that profile is also written there to reuse). The microbatch, sequence and dtype flags shape
the profiling only, so they are refused without ``--profile-model``: a profile file was measured at its
own sizes, and silently ignoring them would partition costs the user did not ask for.

Prints the stages (layer ranges, numbered from 0 as in the profile, and the processor of each), the
partitioning DP's period and the period of the valid schedule; ``--json`` prints
``{"algorithm", "period_s", "valid_period_s", "stages": [{"layers": [first, last], "processor": p}], "pattern"}``.
``--out FILE`` writes that allocation as a plan file (:func:`~jaxhybrid.planner.plan.write_allocation`) that
``jaxhybrid train --set plan.file=FILE`` trains: one pipeline rank per processor, the stages' layers as the
model's blocks (a profile of ``--profile-model`` has one layer per block), and the valid schedule as the
``periodic`` pattern.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

from jaxhybrid.cli.commands.plan import model_and_config
from jaxhybrid.core.argtypes import check_seq_len, check_writable, positive_int
from jaxhybrid.planner.chain import Chain, chain_ranks, check_platform, check_processors
from jaxhybrid.planner.costs import load_profile, save_profile
from jaxhybrid.planner.madpipe import madpipe
from jaxhybrid.planner.madpipe_dp import grid_sizes
from jaxhybrid.planner.pipedream import pipedream
from jaxhybrid.planner.plan import write_allocation
from jaxhybrid.planner.profile import profile_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="", metavar="FILE", help="profile JSON {input_bytes, layers: [...]} to "
                   "partition; with --profile-model, where the new profile is written (overwritten)")
    p.add_argument("--processors", type=int, required=True, help="P, number of GPUs")
    p.add_argument("--memory", type=float, required=True, help="M, bytes per GPU")
    p.add_argument("--bandwidth", type=float, required=True, help="beta, bytes/s between GPUs")
    p.add_argument("--algorithm", choices=("madpipe", "pipedream"), default="madpipe",
                   help="madpipe: MadPipe's DP with a special processor and period search; pipedream: PipeDream's DP "
                        "(both then scheduled by 1F1B*)")
    p.add_argument("--grid", type=grid_sizes, default="101,11,51", help="MadPipe grid sizes of t_P, m_P, V")
    p.add_argument("--iterations", type=positive_int, default=10, help="K of MadPipe's Algorithm 1 (>= 1)")
    p.add_argument("--profile-model", default="", metavar="CFG", help="instead of reading --profile, profile the "
                   "stage kernels of this model (a preset, or a run config's model) on the current device (and "
                   "write them to --profile if given)")
    only = "; only with --profile-model (an error with a --profile FILE alone, which has its own)"
    p.add_argument("--microbatch-size", type=positive_int, default=None, help="sequences per microbatch "
                   f"(default: a run config's microbatch size, or 1 for a preset){only}")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence, at most the model's "
                   f"max_seq_len (default: a run config's data.seq_len, or max_seq_len for a preset){only}")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help=f"compute dtype (default: a run config's precision.compute_dtype, or float32){only}")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: algorithm, period_s, valid_period_s, stages (layers, processor), "
                        "pattern")
    p.add_argument("--out", default="", metavar="FILE", help="write the allocation (stages, processors and its "
                   "periodic pattern) as a plan file: `jaxhybrid train --set plan.file=FILE` trains it, each "
                   "processor a pipeline rank, the special processor's stages on one rank")


def result_json(alloc) -> dict:
    """The allocation with processors numbered in chain order (the first layers' processor is 0, the
    pipeline's first rank): MadPipe's DP numbers its special processor last wherever its layers sit."""
    fin = (lambda x: x if math.isfinite(x) else None)
    stages = sorted(alloc.stages, key=lambda s: s.first)
    rank = chain_ranks(stages)
    return {"algorithm": alloc.algorithm, "period_s": fin(alloc.period), "valid_period_s": fin(alloc.valid_period),
            "stages": [{"layers": [s.first - 1, s.last - 1], "processor": rank[s.processor]} for s in stages],
            "pattern": list(alloc.pattern), "note": alloc.note}


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
    if args.algorithm == "pipedream":
        return f"about --memory={hi:.4g} bytes would fit with {args.processors} processors"
    # MadPipe's DP is too slow to bisect; PipeDream + 1F1B*'s threshold bounds what MadPipe needs.
    return (f"PipeDream + 1F1B* fits from about --memory={hi:.4g} bytes with {args.processors} processors "
            f"(MadPipe, not bisected, may need less)")


_PROFILING_FLAGS = (("--microbatch-size", "microbatch_size"), ("--seq-len", "seq_len"), ("--dtype", "dtype"))


def _profile(args: argparse.Namespace):
    """The profile to partition and what it was measured for (``{}`` for a profile file: the model, its
    settings and the profiling sizes otherwise); every argument is checked before a model is profiled (the
    slow part)."""
    if args.out:
        check_writable(args.out, "--out")
    if not args.profile_model:
        if not args.profile:
            raise ValueError("give --profile FILE (a profile JSON) or --profile-model CFG (profile a model "
                             "preset or run config on this device)")
        given = [f"{flag} {getattr(args, key)}" for flag, key in _PROFILING_FLAGS if getattr(args, key) is not None]
        if given:
            one = len(given) == 1
            raise ValueError(f"{', '.join(given)} {'applies' if one else 'apply'} only with --profile-model (to "
                             f"shape its profiling); --profile {args.profile} was measured at its own sizes: drop "
                             f"{'it' if one else 'them'}, or profile anew with --profile-model")
        profile = load_profile(args.profile)
        check_processors(args.processors, len(profile.layers), "--processors")
        return profile, {}

    model, cfg = model_and_config(args.profile_model, "--profile-model")
    check_processors(args.processors, model.n_layers, "--processors")  # one chain layer per block
    check_seq_len(args.seq_len, model)
    if args.profile:
        check_writable(args.profile, "--profile")
    mb = args.microbatch_size if args.microbatch_size is not None else (cfg.microbatch_size if cfg else 1)
    seq = args.seq_len if args.seq_len is not None else (cfg.data.seq_len if cfg else model.max_seq_len)
    dtype = args.dtype or (cfg.precision.compute_dtype if cfg else "float32")
    profile = profile_model(model, mb, seq, dtype)
    if args.profile:
        save_profile(profile, args.profile)
    return profile, {"model": model.name, "model_config": dataclasses.asdict(model), "dtype": dtype, "seq_len": seq,
                     "microbatch_size": mb}


def run(args: argparse.Namespace) -> int:
    check_platform(args.memory, args.bandwidth, ("--memory", "--bandwidth"))
    profile, meta = _profile(args)
    chain = Chain.from_profile(profile, args.memory, args.bandwidth)
    if args.algorithm == "madpipe":
        alloc = madpipe(chain, args.processors, args.iterations, args.grid)
    else:
        alloc = pipedream(chain, args.processors)
    if not alloc.stages:
        raise ValueError(f"no partition of the {chain.L} layers fits in --memory={args.memory:.4g} bytes on "
                         f"{args.processors} processors; {smallest_fit(profile, args)}")
    out = result_json(alloc)
    if args.out:
        write_allocation(args.out, out, meta)
    if args.json:
        print(json.dumps(out))
        return 0
    note = f" ({alloc.note})" if alloc.note else ""
    print(f"{alloc.algorithm}: DP period {alloc.period:.6g} s, valid schedule period {alloc.valid_period:.6g} s{note}")
    for s in out["stages"]:
        print(f"  layers {s['layers'][0]:3d}-{s['layers'][1]:3d}  processor {s['processor']}")
    print(f"  pattern (one period; F/B<stage>+<shift>): {' '.join(out['pattern'])}")
    if args.out:
        print(f"wrote {args.out}: train it with `jaxhybrid train ... --set plan.file={args.out}`")
    return 0
