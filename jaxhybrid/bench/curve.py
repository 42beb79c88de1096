"""``jaxhybrid bench curve``: measure the planner's compute curve on this device and fit it.

For each ``--case MODEL:MICROBATCH`` it times a middle stage of ``--blocks`` blocks, forward and fused
backward (:class:`~jaxhybrid.parallel.twobp.stage.Stage`), and fits ``seconds per block = flops / (efficiency x
peak) + overhead`` (:func:`~jaxhybrid.planner.machine.fit_compute_model`), which a hardware file's
``compute_model`` holds for ``jaxhybrid plan``. On a GPU the time is the device's busy time, from the
profiler's device timeline (the sum of the call's kernel durations). It has no host dispatch in it, which
a pipeline's asynchronous dispatch hides, and no gaps between kernels. Elsewhere it is the wall time of a
synchronous call. Prints JSON: the rows, the fit, and the line for the hardware file.
"""
from __future__ import annotations

import argparse
import glob
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.core.argtypes import positive_int
from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.core.hardware import run_peak_flops
from jaxhybrid.model import Model, resolve_model
from jaxhybrid.model.flops import forward_flops
from jaxhybrid.parallel.twobp.stage import Stage
from jaxhybrid.planner.machine import fit_compute_model


def _case(text: str) -> tuple[str, int]:
    name, _, mb = text.partition(":")
    if name not in PRESETS or not mb.isdigit() or int(mb) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give MODEL:MICROBATCH, a preset ({', '.join(PRESETS)}) and "
                                         f"sequences per microbatch >= 1, e.g. gpt2-small:8")
    return name, int(mb)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--case", dest="cases", type=_case, action="append", default=None, metavar="MODEL:MB",
                   help="a stage to time (repeat; default: gpt-tiny at 1, 2, 4 and 8 sequences)")
    p.add_argument("--blocks", type=positive_int, default=2, help="blocks per stage (a middle stage)")
    p.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per sequence (at most each model's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on a GPU, float32 elsewhere")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for the dtype (default: "
                   "its configs/hardware file's, found by device kind)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed calls per pass (median reported)")


def busy_times(calls: dict, repeats: int) -> tuple[dict[str, float], str]:
    """Median seconds per call of each ``calls[name]()``: the device's busy time in the call, from the
    profiler's device timeline, or (no device timeline: the CPU) the call's wall time."""
    with tempfile.TemporaryDirectory() as tdir:
        jax.profiler.start_trace(tdir)
        try:
            for _ in range(repeats):
                for name, fn in calls.items():
                    with jax.profiler.TraceAnnotation("curve:" + name):
                        jax.block_until_ready(fn())
        finally:
            jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{tdir}/**/*.xplane.pb", recursive=True)[0])
    host = [e for pl in data.planes if pl.name == "/host:CPU" for ln in pl.lines for e in ln.events]
    marks = [(e.name.split(":", 1)[1], e.start_ns, e.start_ns + e.duration_ns) for e in host
             if e.name.startswith("curve:")]
    kernels = [(e.start_ns, e.duration_ns) for pl in data.planes if pl.name.startswith("/device:")
               for ln in pl.lines for e in ln.events]
    per: dict[str, list[float]] = {name: [] for name in calls}
    for name, a, b in marks:
        per[name].append(sum(d for s, d in kernels if a <= s <= b) if kernels else b - a)
    if kernels and not all(min(v) > 0 for v in per.values()):
        raise RuntimeError(f"the profiler's device timeline holds no kernels inside some calls ({per}); its clock "
                           f"may not match the host's here: time this device with bench stage instead")
    return {k: float(np.median(v)) / 1e9 for k, v in per.items()}, "device_busy" if kernels else "wall"


def run(args: argparse.Namespace) -> int:
    device = jax.devices()[0]
    dtype = args.dtype or ("bfloat16" if device.platform == "gpu" else "float32")
    peak = args.peak_tflops
    if peak is not None and not 0 < peak < float("inf"):
        raise ValueError(f"--peak-tflops {peak} must be a positive number")
    if peak is None:  # the peak a training run's MFU divides by (metrics.hardware: auto)
        flops, why = run_peak_flops("auto", dtype, device)
        if flops is None:
            raise ValueError(f"{why}; or pass --peak-tflops")
        peak = flops / 1e12
    cases = args.cases or [("gpt-tiny", b) for b in (1, 2, 4, 8)]
    for name in {name for name, _ in cases}:  # every case checked before the first is measured
        n = resolve_model(name).n_layers
        if args.blocks + 2 > n:  # a middle stage: no embedding or head in the curve
            raise ValueError(f"--blocks {args.blocks}: a middle stage of {name} ({n} blocks) has at most {n - 2}")
    rows, points = [], []
    for name, mb in cases:
        cfg = resolve_model(name)
        seq = min(args.seq_len, cfg.max_seq_len)
        stage = Stage(Model(cfg, compute_dtype=dtype), 1, 1 + args.blocks)
        params = stage.init_params(jax.random.key(0))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((mb, seq, cfg.d_model)), stage.model.dtype)
        y, res = stage.forward(params, x)
        dy = jnp.ones_like(y)
        calls = {"forward": lambda: stage.forward(params, x), "backward": lambda: stage.backward(res, dy)}
        for fn in calls.values():  # compile and warm outside the timing
            jax.block_until_ready(fn())
        t, timing = busy_times(calls, args.repeats)
        flops = forward_flops(cfg, mb, seq, 1, head=False)  # one block's forward; its backward is twice that
        rows.append({"model": name, "microbatch_size": mb, "seq_len": seq, "blocks": args.blocks,
                     "forward_s_per_block": t["forward"] / args.blocks, "backward_s_per_block": t["backward"] / args.blocks,
                     "forward_tflops": flops * args.blocks / t["forward"] / 1e12,
                     "backward_tflops": 2 * flops * args.blocks / t["backward"] / 1e12})
        points += [(flops, t["forward"] / args.blocks, 0), (2 * flops, t["backward"] / args.blocks, 1)]
    fit = fit_compute_model(points, peak * 1e12)
    entry = {"efficiency": float(f"{fit['efficiency']:.3g}"),
             "block_overhead_s": [float(f"{v:.3g}") for v in fit["block_overhead_s"]]}
    print(json.dumps({"device": device.device_kind, "dtype": dtype, "timing": timing, "peak_tflops": peak,
                      "rows": rows, "fit": fit, "hardware_file_line": f"compute_model: {{{dtype}: {json.dumps(entry)}}}"}))
    return 0
