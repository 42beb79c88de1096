"""``jaxhybrid bench pipeline --stages P --schedule NAME [--json]``: pipeline throughput with and without 2BP.

Started as one process, it relaunches itself under the venv's ``mpiexec`` with ``P`` ranks (thread pools
sized to ``cores // P``, each rank pinned to its share of the cores). Every rank builds its stage once; the fused schedule and its 2BP twin (and the
same 2BP schedule over the other transport) then run the same model and batch, interleaved in rounds so
machine noise hits all alike. A step is timed from a barrier to the slowest rank's end of the pipeline
phase, its gradients computed (no optimizer). Printed JSON:

- ``throughput_fused`` / ``throughput_split``: tokens/s; ``gain`` = split / fused;
- ``theoretical_gain``: the simulated makespan ratio with F = BI = BW (2BP Table 1 for naive, GPipe,
  1F1B-1, 1F1B-2; the same simulator for the others);
- ``expected_gain``: the same simulation with the kernel times this run measured per stage (``kernel_ms``:
  F, fused B, BI, BW per microbatch, medians), messages free: what 2BP can gain with these kernels, which
  are not Table 1's equal ones; ``gain_over_expected`` is how much of it the run realised;
- ``event_loop_overhead``: on the 2BP run, the largest over ranks of wall time spent neither in stage
  kernels nor on messages (blocked receives, sends, receives), over the rank's wall time;
- ``message_fraction``: time on messages over wall time (same run); ``kernel_time_ratio``: the stage
  kernels' time with 2BP over without (largest over ranks; > 1 is fusion lost by splitting);
  ``throughput_split_<other>`` and
  ``transport_ratio`` (this transport over the other) for the transport choice.

Those runs time every task (``PipelineEngine.time_tasks``: each waits for its kernel), which the kernel
medians need. The fused and 2BP schedules also run as training runs them, dispatching asynchronously
(Myelin Sec. IV-A, :mod:`~jaxhybrid.parallel.pipeline.event_loop`), in the same rounds: ``step_s_median`` per run and
``async_over_sync`` (median step time, asynchronous over timed, per schedule; < 1 is the host dispatch
the timed loop left the device idle for).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxhybrid.cli.commands.launch import find_mpiexec, job_cpus, rank_environment
from jaxhybrid.core.argtypes import nonnegative_int, positive_int
from jaxhybrid.core.config.model import resolve_model
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.topology import Topology

WORKER_FLAG = "--worker"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=positive_int, required=True, help="pipeline stages P (= MPI ranks)")
    p.add_argument("--schedule", default="1f1b-1", help="pipeline.schedule, as in simulate --schedule")
    p.add_argument("--microbatches", type=int, default=0, help="default: what the schedule implies (P or 2P)")
    p.add_argument("--model", default="gpt-small-cpu", help="model preset")
    p.add_argument("--layers", type=int, default=0, help="override n_layers (default: preset, at least P)")
    p.add_argument("--microbatch-size", type=positive_int, default=4, help="sequences per microbatch")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--transport", default="mpi4jax", choices=("mpi4jax", "mpi4py"),
                   help="pipeline.transport: how activations cross the stages")
    p.add_argument("--weight-join", default="auto", choices=("auto", "sum", "concat"),
                   help="pipeline.weight_join: how a deferred weight pass takes several microbatches")
    p.add_argument("--rounds", type=positive_int, default=5, help="timed rounds, each running every variant once")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first (compiling)")
    p.add_argument("--cores", type=positive_int, default=None, help="cores shared by the ranks (default: all)")
    p.add_argument("--timeout", type=int, default=600, help="seconds the mpirun job may take (MPIEXEC_TIMEOUT)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)


def default_microbatches(schedule: str, p: int) -> int:
    if schedule.startswith("1f1b-") and schedule[5:].isdigit():
        return int(schedule[5:]) * p
    return 1 if schedule == "naive" else p


def theoretical_gain(schedule: str, p: int, m: int, costs=None) -> float:
    """Makespan(fused) / makespan(2BP) under ``costs`` (default: unit F, BI, BW, 2BP Table 1's assumption;
    the fused B then costs BI + BW)."""

    fused = simulate(make_schedule(schedule, p, m, split_backward=False), costs).makespan
    split = simulate(make_schedule(schedule, p, m, split_backward=True), costs).makespan
    return fused / split


def kernel_seconds(events) -> dict[tuple[int, str], list[float]]:
    """Per (stage, kind F/B/BI/BW), the seconds per microbatch of one step's kernels; a joined BW over K
    microbatches counts K times its duration / K (the simulator's cost of a joined BW, 2BP Fig. 2)."""
    out: dict[tuple[int, str], list[float]] = {}
    for e in events:
        if e.kind in ("F", "B", "BI", "BW") and e.microbatches:
            n = len(e.microbatches)
            out.setdefault((e.stage, e.kind), []).extend([e.duration / n] * n)
    return out


def measured_costs(per_step: list[dict], stages: int):
    """:class:`~jaxhybrid.parallel.pipeline.costs.Costs` from the kernels this run timed (:func:`kernel_seconds` of
    every rank's steps; medians per stage, F over the fused and the 2BP runs), messages free: the
    schedule's gain on this machine's kernels."""
    import numpy as np

    merged: dict[tuple[int, str], list[float]] = {}
    for d in per_step:
        for key, v in d.items():
            merged.setdefault(key, []).extend(v)
    missing = [(s, k) for s in range(stages) for k in ("F", "B", "BI", "BW") if not merged.get((s, k))]
    if missing:
        raise ValueError(f"no timed kernels for (stage, kind) {missing}")
    med = {key: float(np.median(v)) for key, v in merged.items()}
    per = {k: tuple(med[s, k] for s in range(stages)) for k in ("F", "B", "BI", "BW")}
    return Costs(per["F"], per["BI"], per["BW"], backward=per["B"])


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    cpus = job_cpus(args.cores or 0)  # each rank pinned to its share, as `jaxhybrid launch` runs them
    env = rank_environment(args.stages, cpus, args.timeout)
    cmd = [find_mpiexec(), "-n", str(args.stages), sys.executable, "-m", "mpi4py", "-m", "jaxhybrid", "bench",
           "pipeline", *argv, WORKER_FLAG]
    return subprocess.call(cmd, env=env)


def activation_bytes(cfg) -> float:
    """What the busiest rank stashes under the 2BP run (every microbatch until its weight pass): the
    planner's per-block count (:func:`~jaxhybrid.planner.memory.block_residual_bytes`, float32, XLA
    attention) times the largest stage's blocks, plus the head's on the last stage."""
    from jaxhybrid.planner.memory import block_residual_bytes, head_residual_bytes, stashed_microbatches

    pl, mb, seq = cfg.pipeline, cfg.microbatch_size, cfg.data.seq_len
    stash = max(stashed_microbatches(pl.schedule, cfg.parallel.pipeline, pl.microbatches, split_backward=True))
    blocks = -(-cfg.model.n_layers // cfg.parallel.pipeline)
    per_mb = blocks * sum(block_residual_bytes(cfg.model, seq, mb, 4)) + sum(head_residual_bytes(cfg.model, seq, mb, 4))
    return stash * per_mb


def run(args: argparse.Namespace) -> int:
    m = args.microbatches or default_microbatches(args.schedule, args.stages)

    make_schedule(args.schedule, args.stages, m)  # bad input fails here, before any launch
    cfg = _cfg(args, m, args.transport)  # so do the model, its layers and the batch (validated)
    if not args.worker:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        need = activation_bytes(cfg) * args.stages
        if need > ram:  # would end in an out-of-memory abort on some rank, after the launch
            raise ValueError(f"--stages {args.stages} --microbatch-size {args.microbatch_size} --seq {args.seq} "
                             f"(model {args.model}, {cfg.model.n_layers} layers, {m} microbatches): the ranks "
                             f"would stash about {need / 2**30:.1f} GiB of activations, more than this "
                             f"machine's {ram / 2**30:.1f} GiB")
        argv = [a for a in sys.argv[sys.argv.index("pipeline") + 1:]] if "pipeline" in sys.argv else []
        return _launch(args, argv)
    return _worker(args, m)


def _cfg(args: argparse.Namespace, m: int, transport: str):
    from jaxhybrid.runtime.config_load import config_from_dict

    base = resolve_model(args.model)
    layers = args.layers or max(base.n_layers, args.stages)
    return config_from_dict({
        "model": {"name": args.model, "n_layers": layers, "max_seq_len": max(base.max_seq_len, args.seq)},
        "data": {"seq_len": args.seq}, "train": {"global_batch": m * args.microbatch_size},
        "parallel": {"pipeline": args.stages, "data": 1},
        "pipeline": {"schedule": args.schedule, "microbatches": m, "transport": transport, "watchdog_s": 600.0,
                     "weight_join": args.weight_join}})


def step_wall(engine, params, batch, world) -> float:
    """One pipeline phase of ``engine`` from a barrier until the slowest rank's gradients are computed."""
    import jax
    from mpi4py import MPI

    world.Barrier()
    t0 = time.perf_counter()
    _, grads = engine.loss_and_grads(params, batch, 1.0)
    jax.block_until_ready(grads)  # dispatched asynchronously, they may still be computing
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def _step(engine, params, batch, world) -> tuple[float, dict]:
    wall = step_wall(engine, params, batch, world)
    rec = engine.loop.recorder
    loop_wall = engine.loop.wall_s  # this rank's event loop, first task to the end of the flush
    compute = rec.total("F", "B", "BI", "BW")
    messages = rec.total("wait", "send", "recv")
    return wall, {"compute": compute, "messages": messages, "wall": loop_wall, "kernels": kernel_seconds(rec.events)}


def _worker(args: argparse.Namespace, m: int) -> int:
    import jax
    import numpy as np

    from jaxhybrid.model import Model
    from jaxhybrid.runtime.engines.pipeline import PipelineEngine

    other = "mpi4py" if args.transport == "mpi4jax" else "mpi4jax"
    cfg = _cfg(args, m, args.transport)
    topo = Topology.from_config(cfg)
    model = Model(cfg.model)
    main = PipelineEngine(cfg, model, topo)
    alt = PipelineEngine(_cfg(args, m, other), model, topo, stage=main.stage)
    params = main.init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, args.seq + 1)).astype(np.int32)
    # (engine, 2BP, timed tasks): timed runs give the kernel medians, the asynchronous ones training's pace.
    runs = {"fused": (main, False, True), "split": (main, True, True), f"split_{other}": (alt, True, True),
            "fused_async": (main, False, False), "split_async": (main, True, False)}
    times = {k: [] for k in runs}
    shares = {k: [] for k in runs}
    for r in range(args.warmup + args.rounds):
        for key, (engine, split, timed) in runs.items():
            engine.set_schedule(args.schedule, split)
            engine.time_tasks(timed)
            wall, share = _step(engine, params, batch, topo.world)
            if r >= args.warmup:
                times[key].append(wall)
                shares[key].append(share)
    tokens = cfg.train.global_batch * args.seq
    best = {k: min(v) for k, v in times.items()}  # least-disturbed round of each
    median = {k: float(np.median(v)) for k, v in times.items()}
    split_shares = shares["split"]
    overhead = max(1 - (s["compute"] + s["messages"]) / s["wall"] for s in split_shares if s["wall"] > 0)
    msg_frac = max(s["messages"] / s["wall"] for s in split_shares if s["wall"] > 0)
    # Kernel time of 2BP over fused on this rank: > 1 means the split kernels cost more than the fused
    # backward (lost fusion), which caps the gain below Table 1's equal-cost assumption.
    kernel = min(x["compute"] for x in split_shares) / max(min(x["compute"] for x in shares["fused"]), 1e-12)
    kernel = topo.world.allreduce(kernel, op=_max())
    # Every rank's kernels in the fused and the 2BP runs (same transport), for the simulator on rank 0.
    steps = topo.world.gather([x["kernels"] for x in shares["fused"] + shares["split"]], root=0)
    joins = topo.world.gather(dict(sorted(main.loop.join.chosen.items())), root=0)  # per rank: size -> join
    overhead = topo.world.allreduce(overhead, op=_max())
    msg_frac = topo.world.allreduce(msg_frac, op=_max())
    if topo.rank == 0:
        costs = measured_costs([d for rank in steps for d in rank], args.stages)
        gain, expected = best["fused"] / best["split"], theoretical_gain(args.schedule, args.stages, m, costs)
        out = {"stages": args.stages, "schedule": args.schedule, "microbatches": m, "model": args.model,
               "microbatch_size": args.microbatch_size, "seq": args.seq, "transport": args.transport,
               "weight_join": cfg.pipeline.weight_join,
               # What each stage's weight passes took, by microbatches joined (auto decides per stage and size).
               "weight_join_chosen": {f"stage{i}": {str(k): v for k, v in j.items()} for i, j in enumerate(joins)},
               "throughput_fused": tokens / best["fused"], "throughput_split": tokens / best["split"],
               "gain": gain, "theoretical_gain": theoretical_gain(args.schedule, args.stages, m),
               "expected_gain": expected, "gain_over_expected": gain / expected,
               "kernel_ms": {k: [round(1e3 * v, 3) for v in getattr(costs, f)] for k, f in
                             (("F", "forward"), ("B", "backward"), ("BI", "backward_input"), ("BW", "backward_weight"))},
               "event_loop_overhead": overhead, "message_fraction": msg_frac, "kernel_time_ratio": kernel,
               f"throughput_split_{other}": tokens / best[f"split_{other}"],
               "transport_ratio": best[f"split_{other}"] / best["split"],
               "step_s": best, "step_s_median": median,
               "async_over_sync": {k: median[f"{k}_async"] / median[k] for k in ("fused", "split")},
               "rounds": args.rounds}
        print(json.dumps(out) if args.json else json.dumps(out, indent=2), flush=True)
    main.close()
    alt.close()
    return 0


def _max():
    from mpi4py import MPI

    return MPI.MAX
