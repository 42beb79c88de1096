"""``jaxhybrid simulate``: predict a pipeline schedule's makespan, bubble ratio and per-rank memory.

Example::

    jaxhybrid simulate --schedule 1f1b --stages 4 --microbatches 8 --split-backward --costs 1,1,1 --json
    jaxhybrid simulate --schedule interleaved-1f1b --stages 4 --virtual-stages 2 --microbatches 8 --json

``--stages`` is the pipeline ranks; with ``--virtual-stages V`` the model is cut into stages x V logical stages
(placed on the ranks by ``--placement``), and ``--costs`` and the per-stage byte lists are per logical stage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from jaxhybrid.core.argtypes import check_writable, positive_int
from jaxhybrid.parallel.pipeline.costs import parse_costs
from jaxhybrid.parallel.pipeline.schedule import PLACEMENTS, SCHEDULE_NAMES, make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.trace import save_gantt, write_chrome_trace
from jaxhybrid.parallel.pipeline.validate import validate_schedule


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", required=True, help=f"one of {', '.join(SCHEDULE_NAMES)} (or 1f1b-K)")
    p.add_argument("--stages", type=int, required=True,
                   help="pipeline ranks P (P stages, or P x V with --virtual-stages V)")
    p.add_argument("--virtual-stages", type=positive_int, default=1, metavar="V",
                   help="stages per rank (interleaved-1f1b, zb-v (V=2), gpipe, naive, myelin); default 1")
    p.add_argument("--placement", choices=PLACEMENTS, default="loop",
                   help="stages of a rank with --virtual-stages: loop (rank r: r, r+P, ...; Megatron-LM) or v "
                        "(V=2, rank r: r and 2P-1-r; zb-v)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches M per step; required, except for 1f1b-K (default: K x stages)")
    p.add_argument("--split-backward", action="store_true", help="2BP: split B into BI and delayed BW")
    p.add_argument("--memory-saving", action="store_true",
                   help="2BP Fig. 5: also run pending BWs half-way (with --split-backward)")
    p.add_argument("--costs", default="1,1,1", metavar="F,B,W",
                   help="forward, input-gradient and weight-gradient cost per stage (fused B = B + W)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per point-to-point message")
    p.add_argument("--bandwidth", type=float, default=math.inf, help="bytes/s of a point-to-point link")
    p.add_argument("--message-bytes", type=float, default=0.0, help="bytes of one activation message")
    p.add_argument("--activation-bytes", default=None, metavar="A[,A...]",
                   help="bytes a stage stashes per microbatch from F to B/BI: one value, or one per stage "
                        "(default 1: peak_bytes counts microbatches)")
    p.add_argument("--residual-bytes", default=None, metavar="R[,R...]",
                   help="2BP: bytes a stage keeps per microbatch from BI to BW, one value or one per stage "
                        "(default: the activation bytes)")
    p.add_argument("--pipeline-limit", type=positive_int, default=None,
                   help="myelin only: microbatches in flight (default: --stages, the ranks)")
    p.add_argument("--period", type=float, default=None, help="1f1b-star: MadPipe period T")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--table", action="store_true", help="also print the per-rank task order")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--png", default=None, metavar="OUT.png", help="write a Gantt chart")


def _per_stage_bytes(text: str | None, name: str, stages: int) -> tuple[float, ...] | None:
    """``--activation-bytes`` / ``--residual-bytes``: one number for every stage, or one per stage."""
    if text is None:
        return None
    flag = "--" + name.replace("_", "-")
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a number of bytes, or one per stage separated by commas") \
            from None
    if len(vals) not in (1, stages):
        raise ValueError(f"{flag} {text!r}: give one value, or {stages} (one per stage), not {len(vals)}")
    bad = next((v for v in vals if not 0 <= v < math.inf), None)  # the value at fault, not the count
    if bad is not None:
        raise ValueError(f"{flag} {text!r}: {bad:g} is not a finite number >= 0")
    return vals * stages if len(vals) == 1 else vals


def run(args: argparse.Namespace) -> int:
    if args.stages < 1:
        raise ValueError(f"--stages {args.stages} must be >= 1")
    for flag, path in (("--trace", args.trace), ("--png", args.png)):
        if path:  # before the simulation; the writers make missing folders
            check_writable(path, flag, parents=True)
    # The command's flags, not make_schedule's parameter names, in the errors a user can fix here.
    key = args.schedule.lower()  # an unknown name is left to make_schedule, which lists the valid ones
    if args.microbatches is None and key in SCHEDULE_NAMES and not re.fullmatch(r"1f1b-\d+", key):
        raise ValueError(f"--schedule {args.schedule} needs --microbatches M (only 1f1b-K defaults, to K x stages)")
    # A flag of one schedule given with another is refused, not ignored: the result would not be what was asked.
    if args.pipeline_limit is not None and key != "myelin":
        raise ValueError(f"--pipeline-limit applies to --schedule myelin only, not {args.schedule}")
    if key == "zb-v" and (args.virtual_stages, args.placement) != (2, "v"):
        raise ValueError(f"--schedule zb-v is the V shape: it needs --virtual-stages 2 --placement v, got "
                         f"--virtual-stages {args.virtual_stages} --placement {args.placement}")
    if args.placement == "v" and args.virtual_stages != 2:
        raise ValueError(f"--placement v puts stages r and 2P-1-r on rank r: it needs --virtual-stages 2, got "
                         f"{args.virtual_stages}")
    if args.memory_saving and not args.split_backward:
        raise ValueError("--memory-saving needs --split-backward (2BP Fig. 5 runs the delayed weight gradients "
                         "half-way)")
    nstages = args.stages * args.virtual_stages  # the costs are per logical stage (chunk)
    costs = parse_costs(args.costs, nstages, latency=args.latency, bandwidth=args.bandwidth,
                        message_bytes=args.message_bytes)
    sizes = {k: _per_stage_bytes(getattr(args, k), k, nstages) for k in ("activation_bytes", "residual_bytes")}
    costs = dataclasses.replace(costs, **{k: v for k, v in sizes.items() if v is not None})
    opts = {"costs": costs}
    if args.memory_saving:
        opts["memory_saving"] = True
    if args.period is not None:
        if key != "1f1b-star":
            raise ValueError(f"--period applies to --schedule 1f1b-star only, not {args.schedule}")
        opts["period"] = args.period  # stage loads: --costs (make_schedule's default)
    if args.message_bytes and math.isinf(args.bandwidth):
        raise ValueError(f"--message-bytes {args.message_bytes:g} needs --bandwidth BYTES_PER_S: at the default "
                         f"infinite bandwidth a message's size costs nothing")
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, args.split_backward,
                             pipeline_limit=args.pipeline_limit or 0, virtual_stages=args.virtual_stages,
                             placement=args.placement, **opts)
    if args.residual_bytes is not None and not schedule.split_backward:
        raise ValueError(f"--residual-bytes weighs what 2BP keeps from BI to BW: it needs --split-backward "
                         f"(zb-h1 and zb-v are always split); {args.schedule} without it keeps --activation-bytes per "
                         f"microbatch until the fused backward")
    validate_schedule(schedule, costs=costs)
    result = simulate(schedule, costs)
    if args.trace:
        write_chrome_trace(result.timeline, args.trace, process_name=f"simulated {schedule.name}")
    if args.png:
        chunks = f", V={args.virtual_stages} ({args.placement})" if args.virtual_stages > 1 else ""
        title = (f"{schedule.name}{' + 2BP' if schedule.split_backward else ''}: P={schedule.num_ranks}{chunks}, "
                 f"M={schedule.num_microbatches}, bubble {result.bubble_ratio:.3f}")
        save_gantt(result.timeline, args.png, title)
    out = {"schedule": schedule.name, "stages": schedule.num_ranks, "virtual_stages": args.virtual_stages,
           "placement": args.placement, "microbatches": schedule.num_microbatches,
           "split_backward": schedule.split_backward, "policy": schedule.policy, **result.to_dict()}
    out.pop("idle_total")
    if args.table:
        out["table"] = schedule.table().splitlines()
    if args.json:
        print(json.dumps(out))
        return 0
    chunks = f" virtual_stages={args.virtual_stages} placement={args.placement}" if args.virtual_stages > 1 else ""
    print(f"{schedule.name}{' + 2BP' if schedule.split_backward else ''}: stages={schedule.num_ranks}{chunks} "
          f"microbatches={schedule.num_microbatches} makespan={result.makespan:g} "
          f"bubble_ratio={result.bubble_ratio:.4f}")
    for r, st in enumerate(result.per_rank):
        print(f"  rank {r}: busy={st.busy:g} idle={st.idle:g} peak_stashed={st.peak_stashed} "
              f"peak_bytes={st.peak_bytes:g}")
    if args.table:
        print(schedule.table())
    return 0
