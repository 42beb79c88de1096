"""``jaxhybrid bench stage``: the 2BP stage kernels timed side by side in one run.

Times, on one stage and one microbatch: ``forward``, the fused ``backward``, ``backward_input`` and
``backward_weight`` (single; on K microbatches concatenated as 2BP Fig. 2; on the list of K, summed in one
program, ``pipeline.weight_join``), plus a plain reference (``jax.vjp`` of the same slice, forward and
backward in separate jits). Rounds interleave the variants in a fresh random order, so noise and cache
warmth hit all alike; each figure is a median over rounds, ``split_over_fused_rounds_iqr`` the quartile
range of the per-round ratio.

Prints JSON with ``split_over_fused = (input + weight) / fused`` (goal <= 1.05): the input pass and its
weight pass called back to back under one ``block_until_ready``, as the fused one is timed. Why not each
pass with its own sync (``split_over_fused_per_call``): that charges the split a second call's fixed host
cost, large on a GPU (argument parsing, buffers, the CUDA graph launch), which no 2BP schedule pays, since
it runs the weight pass later behind queued work or in an idle gap. ``split_over_fused_queued`` queues 8
calls per sync: the device-bound cost. ``noop_call_s`` and ``dispatch_s`` show the host's share.
``grad_max_rel_err`` is the split against the reference, over dx and every param leaf.

``split_over_fused_cold`` / ``_warm`` flush the caches before each call, or run it right after the same
kernel, each pass on its own sync: the split reads back what the input pass stored for the weight pass
(2BP's cost in memory traffic), so cold is the pipeline's case and warm its lower bound.
``split_sum_over_fused`` and ``split_concat_over_fused`` add separately synchronised calls too.

``xla_costs``, ``split_flops_over_fused`` and ``split_bytes_over_fused``: XLA's own count of the compiled
kernels' flops, bytes and launching instructions (:mod:`jaxhybrid.parallel.twobp.stage_costs`), the same on
every machine: what the split adds in work, apart from locality and per-call cost (null on a GPU, where
XLA's count misses library calls).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.bench.stage_timing import cache_times, dispatch_times, noop_call_s, queued_times, time_call
from jaxhybrid.core.argtypes import positive_int
from jaxhybrid.core.config.model import REMATS
from jaxhybrid.model import Model, resolve_model
from jaxhybrid.model.flops import forward_flops
from jaxhybrid.model.testing import max_rel_err
from jaxhybrid.parallel.twobp.stage import Stage, auto_weight_join, concat_weight_residuals, reference_apply
from jaxhybrid.parallel.twobp.stage_costs import kernel_costs, split_ratios
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.host_alloc import host_malloc_status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="run config YAML (model, data.seq_len, microbatch size, dtype)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override as in train, e.g. --set model.d_model=768 (a preset's width changed)")
    p.add_argument("--model", default=None, help="model preset (overrides the config's)")
    p.add_argument("--blocks", default="4", help="N (a middle stage of N blocks) or LO:HI (block range)")
    p.add_argument("--microbatch-size", type=positive_int, default=None, help="default: the config's, else 4")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the config's data.seq_len")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the config's precision.compute_dtype)")
    p.add_argument("--remat", default="none", choices=REMATS, help="train.remat of the stage's blocks")
    p.add_argument("--concat", type=positive_int, default=4, help="K microbatches for the concatenated weight pass")
    p.add_argument("--repeats", type=positive_int, default=25, help="timed rounds (median reported)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def _block_range(spec: str, n: int) -> tuple[int, int]:
    parts = spec.split(":")
    if len(parts) > 2 or not all(v.strip().isdigit() for v in parts):
        raise ValueError(f"--blocks {spec!r}: give N (a stage of N blocks) or LO:HI (a block range), "
                         f"whole numbers")
    if len(parts) == 2:
        lo, hi = (int(v) for v in parts)
        return lo, hi
    k = int(spec)
    if k < 1 or k > n:
        raise ValueError(f"--blocks {k} must be in [1, n_layers={n}]")
    lo = 1 if k + 2 <= n else 0  # a middle stage when the model has room for one
    return lo, lo + k


def run(args: argparse.Namespace) -> int:
    clash = [o for o in args.overrides if o.startswith("model.")]
    if args.model and clash:
        raise ValueError(f"--model {args.model} replaces the whole model config, so {', '.join(clash)} would be "
                         f"lost: give the preset as --set model.name={args.model} instead")
    cfg = load_config(args.config, args.overrides) if args.config or args.overrides else None
    mcfg = resolve_model(args.model) if args.model else (cfg.model if cfg else resolve_model("gpt-small-cpu"))
    dtype = args.dtype or (cfg.precision.compute_dtype if cfg else "float32")
    mb = args.microbatch_size or (cfg.microbatch_size if cfg else 4)
    seq = args.seq_len or (cfg.data.seq_len if cfg else min(128, mcfg.max_seq_len))
    lo, hi = _block_range(args.blocks, mcfg.n_layers)
    model = Model(mcfg, compute_dtype=dtype)
    stage = Stage(model, lo, hi, remat=args.remat)
    params = stage.init_params(jax.random.key(0))  # only the stage's parts: a 1.3B stage, not the model
    rng = np.random.default_rng(0)
    if stage.is_first:
        xs = [jnp.asarray(rng.integers(0, mcfg.vocab_size, (mb, seq)), jnp.int32) for _ in range(args.concat)]
    else:
        xs = [jnp.asarray(rng.standard_normal((mb, seq, mcfg.d_model)), model.dtype) for _ in range(args.concat)]
    tgt = jnp.asarray(rng.integers(0, mcfg.vocab_size, (mb, seq)), jnp.int32) if stage.is_last else None
    x = xs[0]

    # Plain reference: jax.vjp of the same slice (fused by XLA as it likes), fwd and bwd in separate jits.
    def apply(p, h):
        return reference_apply(stage, p, h, tgt)

    diff = (lambda p, h: jax.vjp(lambda q: apply(q, h), p)) if stage.is_first else (lambda p, h: jax.vjp(apply, p, h))
    ref_fwd = jax.jit(diff)
    ref_bwd = jax.jit(lambda vjp, dy: vjp(dy))

    y, res = stage.forward(params, x, tgt)
    dy = jnp.ones_like(y) if stage.is_last else jnp.asarray(rng.standard_normal(y.shape), y.dtype)
    dx, wr = stage.backward_input(res, dy)
    g_split = stage.backward_weight(params, wr)
    _, (dx_f, g_fused) = y, stage.backward(res, dy)
    yr, vjp = ref_fwd(params, x)
    ref = ref_bwd(vjp, dy)
    ref_g, ref_dx = (ref[0], None) if stage.is_first else ref
    err = max(max_rel_err(g_split, ref_g), max_rel_err(g_fused, ref_g),
              0.0 if dx is None else max(max_rel_err(dx, ref_dx), max_rel_err(dx_f, ref_dx)))
    wrs = [wr] + [stage.backward_input(stage.forward(params, xi, tgt)[1], dy)[1] for xi in xs[1:]]
    wr_cat = concat_weight_residuals(wrs)
    jax.block_until_ready(stage.backward_weight(params, wr_cat))
    g_sum = jax.tree.map(lambda *a: sum(a[1:], a[0]), *[stage.backward_weight(params, w) for w in wrs])
    concat_err = max_rel_err(stage.backward_weight(params, wr_cat), g_sum)

    sum_err = max_rel_err(stage.backward_weight(params, wrs), g_sum)

    def split_backward(res, dy):
        """One microbatch's split backward, both passes queued, the weight pass on the input pass's
        own weight residuals (what ``split_over_fused`` times against the fused backward)."""
        dx, w = stage.backward_input(res, dy)
        return dx, stage.backward_weight(params, w)

    names = ["forward", "backward_fused", "backward_split", "backward_input", "backward_weight", "backward_weight_concat",
             "backward_weight_sum", "concat", "ref_forward", "ref_backward"]
    calls = {"forward": (stage.forward, params, x, tgt), "backward_fused": (stage.backward, res, dy),
             "backward_split": (split_backward, res, dy),
             "backward_input": (stage.backward_input, res, dy), "backward_weight": (stage.backward_weight, params, wr),
             "backward_weight_concat": (stage.backward_weight, params, wr_cat), "concat": (concat_weight_residuals, wrs),
             "backward_weight_sum": (stage.backward_weight, params, wrs),
             "ref_forward": (ref_fwd, params, x), "ref_backward": (ref_bwd, vjp, dy)}
    per_mb = {"backward_weight_concat": args.concat, "concat": args.concat, "backward_weight_sum": args.concat}
    times: dict[str, list[float]] = {k: [] for k in names}
    order = np.random.default_rng(1)
    for _ in range(args.repeats):
        # A fresh order each round: a kernel that runs right after another reading the same inputs finds
        # them in cache, an advantage a fixed order would hand to the same variant every round.
        for k in order.permutation(names):
            fn, *a = calls[k]
            times[k].append(time_call(fn, *a) / per_mb.get(k, 1))
    med = {k: float(np.median(v)) for k, v in times.items()}
    queued = queued_times(calls, args.repeats, order)
    backwards = ["backward_fused", "backward_input", "backward_weight"]
    # Each pass from a known cache state, so per call: a cold weight pass reads what the input pass stored
    # back from memory, as in a pipeline (the pair would find it still in cache).
    by_cache = cache_times(calls, backwards, args.repeats, order)
    dispatch = dispatch_times(calls, backwards, args.repeats, order)
    cache_ratio = {s: (t["backward_input"] + t["backward_weight"]) / t["backward_fused"] for s, t in by_cache.items()}
    split = med["backward_split"]
    # The spread of the per-round ratio shows how much of split_over_fused is machine noise.
    rounds = np.asarray(times["backward_split"]) / np.asarray(times["backward_fused"])
    q25, q75 = (float(v) for v in np.percentile(rounds, [25, 75]))
    fl = forward_flops(mcfg, mb, seq, hi - lo, head=stage.is_last)
    costs = kernel_costs(stage, params, x, tgt, res, dy, wr)
    out = {
        "model": mcfg.name, "d_model": mcfg.d_model, "d_ff": mcfg.d_ff, "blocks": [lo, hi],
        "microbatch_size": mb, "seq_len": seq, "dtype": dtype,
        "remat": args.remat, "concat_k": args.concat, "repeats": args.repeats,
        "forward_s": med["forward"], "backward_fused_s": med["backward_fused"],
        "backward_input_s": med["backward_input"], "backward_weight_s": med["backward_weight"],
        "backward_weight_concat_s": med["backward_weight_concat"], "concat_s": med["concat"],
        "backward_split_s": split,
        "split_over_fused": split / med["backward_fused"], "split_over_fused_rounds_iqr": [q25, q75],
        # Each pass with its own sync: the split pays a second call's fixed host cost (module docstring).
        "split_over_fused_per_call": (med["backward_input"] + med["backward_weight"]) / med["backward_fused"],
        "backward_weight_sum_s": med["backward_weight_sum"],
        # 2BP's intended use: input pass per microbatch, one weight pass over K of them (per microbatch),
        # the K joined by copying into one batch (Fig. 2; the copy counted) or summed in one program.
        "split_concat_over_fused": (med["backward_input"] + med["concat"] + med["backward_weight_concat"])
        / med["backward_fused"],
        "split_sum_over_fused": (med["backward_input"] + med["backward_weight_sum"]) / med["backward_fused"],
        # (the two ratios above add separately synchronised calls, as split_over_fused_per_call does)
        # What pipeline.weight_join=auto takes for --concat K microbatches of this stage (stage.weight_join).
        "weight_join_auto": auto_weight_join(stage, wr, args.concat), "param_bytes": stage.param_bytes,
        # Device-bound view: calls queued back to back, one sync (an asynchronous runtime's dispatch hides
        # the host's per-call cost behind the kernels already queued; the synchronous ratio above pays it).
        "queued_backward_fused_s": queued["fused"], "queued_split_s": queued["split"],
        "split_over_fused_queued": queued["split"] / queued["fused"],
        # The host's share of a synchronous call: a trivial program's, and each backward's enqueueing.
        "noop_call_s": noop_call_s(args.repeats), "dispatch_s": dispatch,
        # The same ratio from a known cache state: cold (caches flushed before each call) and warm.
        "split_over_fused_cold": cache_ratio["cold"], "split_over_fused_warm": cache_ratio["warm"],
        "cache_state_s": by_cache,
        # The same kernels by XLA's count (deterministic): equal work, so timing gaps are runtime effects.
        "xla_costs": costs, **split_ratios(costs, jax.devices()[0].platform),
        "split_over_plain_vjp": split / med["ref_backward"],
        "fused_over_plain_vjp": med["backward_fused"] / med["ref_backward"],
        "concat_weight_over_single": med["backward_weight_concat"] / med["backward_weight"],
        "plain_vjp_forward_s": med["ref_forward"], "plain_vjp_backward_s": med["ref_backward"],
        "grad_max_rel_err": err, "concat_sum_max_rel_err": concat_err, "list_sum_max_rel_err": sum_err,
        "residual_bytes": Stage.residual_bytes(res), "weight_residual_bytes": Stage.weight_residual_bytes(wr),
        "plain_vjp_residual_bytes": int(sum(v.nbytes for v in jax.tree.leaves(vjp))),
        "forward_tflops": fl / med["forward"] / 1e12, "backward_split_tflops": 2 * fl / split / 1e12,
        "backward_fused_tflops": 2 * fl / med["backward_fused"] / 1e12,
        "goal_split_over_fused": 1.05, "device": jax.devices()[0].device_kind,
        "host_malloc": host_malloc_status(),  # the process's malloc settings (jaxhybrid/runtime/host_alloc.py)
    }
    if not args.json:
        for k, v in out.items():
            print(f"{k:>28}: {v}")
    print(json.dumps(out))
    return 0
