"""``jaxhybrid plan``: rank parallel layouts of a model on a cluster by predicted step time (no devices).

Prints per plan the predicted step time, the exposed communication time and the memory per device, then
any notes (e.g. that latency, which the model ignores, would dominate, or that the best plan needs
several stages per rank to fit or wins with them); ``--json`` prints ``{"plans":
[...], "notes": [...]}``, plans best first (feasible ones only); ``--out PLAN.json`` writes the best plan
with the config overrides that ``jaxhybrid train --set plan.file=PLAN.json`` applies.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from jaxhybrid.core.argtypes import check_seq_len, check_writable, positive_int
from jaxhybrid.core.config.model import PRESETS, resolve_model
from jaxhybrid.core.config.schema import OptimConfig, allreduce_backend_on
from jaxhybrid.core.hardware import peak_tflops
from jaxhybrid.planner.costs import load_hardware, planner_hardware_names
from jaxhybrid.planner.machine import overheads_ok
from jaxhybrid.planner.plan import (
    PLAN_KEYS,
    check_gpus,
    config_layout,
    latency_notes,
    machine_from_hardware,
    rank_plans,
    score_config,
    virtual_stage_notes,
    write_plan,
)
from jaxhybrid.runtime.config_load import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a run config file (its "
                   f"model, batch, sequence and dtype; its own layout is scored beside the plans)")
    p.add_argument("--gpus", type=int, required=True, help="G, total GPUs: a multiple of --gpus-per-node "
                   "(whole nodes) or a divisor of it (part of one node)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs used per node (at most the "
                   "hardware file's gpus_per_node)")
    p.add_argument("--hardware", required=True, help=f"configs/hardware name ({', '.join(planner_hardware_names())})"
                   " or a YAML path with the same keys")
    p.add_argument("--top", type=positive_int, default=10, help="plans to print (>= 1)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="force Myelin's optimizer offload on/off (default: try both)")
    p.add_argument("--shard-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="divide the optimizer state over data replicas that are MPI ranks (ZeRO-1, "
                        "optim.shard_optimizer; default: the config's, else off)")
    p.add_argument("--no-tensor", action="store_true", help="only G_c = G_r = G_d = 1")
    p.add_argument("--global-batch", type=positive_int, default=None, help="sequences per step (default: the "
                   "config's, or 512 for a preset)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence, at most the model's "
                   "max_seq_len (default: the config's data.seq_len, or max_seq_len for a preset)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the config's precision.compute_dtype, or bfloat16 for a preset)")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of peak flop/s large matmuls reach "
                   "(default: the hardware file's measured compute_model for the dtype, else 0.5); given alone, "
                   "no block overhead")
    p.add_argument("--block-overhead", type=_overheads, default=None, metavar="FWD_S,BWD_S",
                   help="seconds each block's forward and backward cost a device beyond their flops, e.g. "
                   "8.1e-5,2.11e-4 (default: the hardware file's compute_model, else 0,0): what makes small "
                   "microbatches run below the efficiency")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="share of each device's memory a plan may fill (default: the hardware file's "
                   "usable_memory_fraction, else 0.9; the rest is CUDA context, XLA scratch, fragmentation)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: the plans, notes and the config's own layout (config_layout)")
    p.add_argument("--out", default="", help="write the best plan (and its config overrides) to this JSON file")
    p.add_argument("--allreduce-backend", choices=("auto", "mpi", "xla"), default=None,
                   help="how MPI data replicas sum gradients, as optim.allreduce_backend (default: a run config's, "
                        "else auto, which is xla on the GPUs planned for): mpi pays the copies to the host and back, "
                        "xla (NCCL) the collective alone")


def _overheads(text: str) -> tuple[float, float]:
    """``--block-overhead FWD_S,BWD_S``: two finite seconds >= 0."""
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if not overheads_ok(vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give two seconds per block, forward and backward, each in "
                                         f"[0, 1), e.g. 8.1e-5,2.11e-4")
    return vals


def model_and_config(spec: str, flag: str = "--model"):
    """``(model config, run config)`` of a preset name (run config None) or of a run config file, validated
    as train validates it: what ``plan --model`` and ``partition --profile-model`` accept."""
    if spec in PRESETS:
        return resolve_model(spec), None
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{flag} {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config file")

    cfg = load_config(path)
    return cfg.model, cfg


def _own_layout(cfg, machine, seq: int, plans: list[dict], backend: str) -> dict:
    """The config's own layout scored by the same step model, and where it would rank among all feasible
    ``plans`` (0: none predicted faster)."""
    lay = config_layout(cfg)
    r = {**lay.to_dict(), **score_config(cfg, machine, seq, backend)}
    r["fits"] = r["memory_per_device_bytes"] <= machine.memory_bytes
    r["rank"] = sum(p["predicted_step_s"] < r["predicted_step_s"] for p in plans)
    return r


def _overhead_text(over: tuple[float, float]) -> str:
    return f" + {over[0] * 1e6:.3g} / {over[1] * 1e6:.3g} us per block forward / backward" if any(over) else ""


def _row(label: str, p: dict) -> str:
    yes = {True: "y", False: "n"}
    limit = (p["pipeline_limit"] or p["pipeline"]) if p["schedule"] == "myelin" and p["pipeline"] > 1 else "-"
    vstages = f"{p['virtual_stages']}{p['placement'][0]}" if p["virtual_stages"] > 1 else "1"
    return (f"{label:>2} {p['pipeline']:4d} {p['data']:4d} {p['tensor_col']:3d} {p['tensor_row']:3d} "
            f"{p['tensor_depth']:3d} {p['microbatch_size']:3d} {p['schedule']:>16} {limit:>3} {vstages:>2} "
            f"{yes[p['split_backward']]:>3} "
            f"{p['remat']:>5} {yes[p['offload']]:>4} {p['predicted_step_s']:9.4g} {p['comm_s']:9.4g} "
            f"{p['memory_per_device_bytes'] / 1e9:7.3g}")


def run(args: argparse.Namespace) -> int:
    check_gpus(args.gpus, args.gpus_per_node)
    hw = load_hardware(args.hardware)
    model, cfg = model_and_config(args.model)
    check_seq_len(args.seq_len, model)
    if args.out:
        check_writable(args.out, "--out")  # before the ranking, not after it
    dtype = args.dtype or (cfg.precision.compute_dtype if cfg else "bfloat16")
    machine = machine_from_hardware(hw, args.gpus_per_node, dtype, args.efficiency, args.memory_fraction,
                                    args.block_overhead)
    efficiency = machine.flops_per_s / (peak_tflops(hw, dtype) * 1e12)  # the file's, or --efficiency
    gb = args.global_batch if args.global_batch is not None else (cfg.train.global_batch if cfg else 512)
    seq = args.seq_len if args.seq_len is not None else (cfg.data.seq_len if cfg else model.max_seq_len)
    bucket = cfg.optim.bucket_size if cfg else OptimConfig.bucket_size  # the offload buckets the run will hold
    # The run's own settings, with which score_config scores its layout (defaults for a preset).
    own_settings = {"letters": cfg.tensor.optimizations, "allreduce_dtype": cfg.optim.allreduce_dtype} if cfg else {}
    # The hardware files plans are made for are GPU nodes: auto is what a run resolves it to there.
    backend = allreduce_backend_on(args.allreduce_backend or (cfg.optim.allreduce_backend if cfg else "auto"),
                                   accelerator=True)
    own_settings["allreduce_backend"] = backend
    own_settings["shard_optimizer"] = (args.shard_optimizer if args.shard_optimizer is not None
                                       else bool(cfg and cfg.optim.shard_optimizer))
    ranked = rank_plans(model, args.gpus, machine, gb, seq, 1 << 30, not args.no_tensor, args.offload, bucket,
                        **own_settings)  # all
    plans = ranked[:args.top]
    notes, own = latency_notes(plans) + virtual_stage_notes(ranked), None
    if cfg is not None:
        if cfg.pipeline.stage_to_rank:  # the step model splits blocks evenly over ranks x virtual stages
            notes.append(f"{args.model}'s own layout places its stages by pipeline.stage_to_rank (a MadPipe "
                         f"allocation), which the step model does not score; `jaxhybrid partition` predicted its "
                         f"period")
        elif cfg.num_devices != args.gpus or (args.global_batch, args.seq_len) != (None, None):
            notes.append(f"{args.model}'s own layout ({cfg.num_devices} devices, global batch "
                         f"{cfg.train.global_batch} x {cfg.data.seq_len}) is scored only with --gpus "
                         f"{cfg.num_devices} and the config's own batch and sequence")
        else:
            own = _own_layout(cfg, machine, seq, ranked, backend)
            if not own["fits"]:
                notes.append(f"{args.model}'s own layout needs {own['memory_per_device_bytes'] / 1e9:.3g} GB per "
                             f"device, more than the {machine.memory_bytes / 1e9:.3g} GB usable of {hw['name']}'s "
                             f"{float(hw['memory_bytes']) / 1e9:.3g} GB (--memory-fraction)")
    if args.out:
        write_plan(args.out, plans[0], {"model": model.name, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
                                        "hardware": hw["name"], "global_batch": gb, "seq_len": seq, "dtype": dtype,
                                        "model_config": asdict(model)})  # a run of other sizes is refused
    keys = PLAN_KEYS + ("microbatches", "remat", "partition", "compute_s", "max_collective_s", "pipeline_s",
                        "data_allreduce_s", "allreduce_staging_s", "offload_s")
    if args.json:
        print(json.dumps({"plans": [{k: p[k] for k in keys} for p in plans], "notes": notes, "efficiency": efficiency,
                          "block_overhead_s": list(machine.block_overhead_s),
                          "config_layout": own and {k: own[k] for k in keys + ("fits", "rank")}}))
        return 0
    print(f"{model.name} on {args.gpus} x {hw['name']} ({args.gpus_per_node}/node), global batch {gb} x {seq} "
          f"tokens, {dtype} at {efficiency:.0%} of peak{_overhead_text(machine.block_overhead_s)}; a plan fills at most {machine.memory_bytes / 1e9:.3g} "
          f"of each device's {float(hw['memory_bytes']) / 1e9:.3g} GB; mb: sequences per microbatch; lim: Myelin's "
          f"microbatches in flight (pipeline_limit); v: stages per rank (virtual_stages), l or v their placement "
          f"(loop or V); data replicas of a pipeline sum gradients by {backend} (optim.allreduce_backend)")
    print(f"{'#':>2} {'pipe':>4} {'data':>4} {'Gc':>3} {'Gr':>3} {'Gd':>3} {'mb':>3} {'schedule':>16} {'lim':>3} "
          f"{'v':>2} {'2BP':>3} {'remat':>5} {'offl':>4} {'step_s':>9} {'comm_s':>9} {'mem_GB':>7}")
    for i, p in enumerate(plans):
        print(_row(str(i), p))
    if own is not None:
        print(f"the config's own layout (would rank #{own['rank']} of {len(ranked)} feasible plans):")
        print(_row("->", own))
    for n in notes:
        print(f"note: {n}")
    return 0
