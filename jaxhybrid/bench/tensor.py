"""``jaxhybrid bench tensor``: AxoNN 4D per factorization, and the effect of optimizations A-E (Fig. 3).

For every factorization of the devices into (G_data, G_d, G_r, G_c): the step time, the collective bytes
of the dense layers read from the compiled HLO against AxoNN eqs. 4-7 (tensor axes) and eq. 8 (data
axis), and the bytes of the collectives eqs. 4-8 do not model (norm statistics, embedding, vocabulary
loss). Then, on one factorization with activation recomputation on, the step time as the
optimizations are switched on one by one (baseline, A, AB, ABC, ABCD, ABCDE), timed in interleaved
rounds so machine noise hits all alike. Prints one JSON object (last; without ``--json``, tables first:
bytes in ``*_B`` columns, ``ratio`` = measured dense bytes / eqs. 4-7).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from jaxhybrid.core.argtypes import positive_int
from jaxhybrid.runtime.host_alloc import default_cpu_devices

LADDER = ("", "A", "AB", "ABC", "ABCD", "ABCDE")


def grid_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``"D,d,r,c;..."``: one or more G_data,G_d,G_r,G_c grids of whole numbers >= 1 (argparse type)."""
    out = []
    for part in text.split(";"):
        vals = part.split(",")
        if len(vals) != 4 or not all(v.strip().isdigit() and int(v) >= 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{part!r} is not G_data,G_d,G_r,G_c (four whole numbers >= 1, "
                                             f"e.g. 1,2,2,2; several separated by ';')")
        out.append(tuple(int(v) for v in vals))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help="model preset")
    p.add_argument("--layers", type=positive_int, default=2, help="override the preset's n_layers")
    p.add_argument("--batch", type=positive_int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    p.add_argument("--devices", type=positive_int, default=8, help="fake CPU devices when JAX is not started yet")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds")
    p.add_argument("--ladder-shape", default=[(1, 2, 2, 2)], type=grid_shapes,
                   help="G_data,G_d,G_r,G_c for the A-E ladder (default 1,2,2,2)")
    p.add_argument("--only", default=None, type=grid_shapes,
                   help="G_data,G_d,G_r,G_c grids to run, ';'-separated (default: every factorization)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def _cfg(args, shape, letters, remat="none"):
    from jaxhybrid.runtime.config_load import load_config

    d, dep, r, c = shape
    return load_config(None, [f"model.name={args.model}", f"model.n_layers={args.layers}",
                              f"train.global_batch={args.batch}", f"data.seq_len={args.seq}",
                              f"model.max_seq_len={max(args.seq, 8)}", f"parallel.data={d}",
                              f"parallel.tensor_depth={dep}", f"parallel.tensor_row={r}",
                              f"parallel.tensor_col={c}", f"tensor.optimizations={letters}",
                              f"train.remat={remat}"])


def _bytes_report(eng, cfg, shape, hlo_text):
    from jaxhybrid.parallel.tensor.linear import NORMAL
    from jaxhybrid.parallel.tensor.sharding import dense_shapes
    from jaxhybrid.planner import hlo

    sizes = eng.dims.mesh_sizes()
    measured = hlo.collectives(hlo_text, shape)
    m_rows = cfg.train.global_batch * cfg.data.seq_len // sizes["data"]
    pred_tensor, pred_data, meas_dense = 0, 0, 0
    for site, (k, n) in dense_shapes(cfg.model).items():
        lay = NORMAL if site == "head.logits" else eng.ops.layout(site)
        count = 1 if site == "head.logits" else cfg.model.n_layers
        for (op, ax), v in hlo.predicted_layer(m_rows, k, n, sizes, lay.transposed).items():
            if not hlo.is_tensor_layer_key((op, ax)):
                pred_data += count * v
            else:
                pred_tensor += count * v
        meas_dense += sum(v for key, v in hlo.totals(measured, f"axonn_{site}/").items()
                          if hlo.is_tensor_layer_key(key))
    relayout = sum(hlo.totals(measured, "axonn_relayout/").values())
    data = sum(c.buffer_bytes for c in measured if not hlo.is_tensor_layer_key((c.op, "+".join(c.axes))))
    total = sum(c.buffer_bytes for c in measured)
    return {"dense_tensor_axes_measured": meas_dense, "dense_tensor_axes_eqs_4_7": pred_tensor,
            "grad_allreduce_data_depth_measured": data, "grad_allreduce_eq_8_dense_only": pred_data,
            "relayout_without_A": relayout, "outside_eqs_4_8": total - meas_dense - relayout - data,
            "total_measured": total, "dense_match": meas_dense == pred_tensor}


def _timed(fns, steps, rounds):
    import jax

    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                out = f()
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / steps)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _engine(args, shape, letters, remat="none"):
    import jax
    import numpy as np

    from jaxhybrid.runtime.engines.tensor import TensorEngine

    cfg = _cfg(args, shape, letters, remat)
    eng = TensorEngine(cfg.model, cfg)
    params = eng.init_params(jax.random.key(0))
    batch = np.random.RandomState(0).randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
    text = eng.lower(params, batch).compile().as_text()
    step = lambda: eng.loss_and_grads(params, batch, 1.0)  # noqa: E731
    jax.block_until_ready(step())  # compile + warm up
    return cfg, eng, text, step


def prepare(args: argparse.Namespace) -> None:
    """``--devices`` fake CPU devices, unless JAX already started or ``XLA_FLAGS`` says otherwise."""
    if "jax" not in sys.modules:
        default_cpu_devices(args.devices)


def run(args: argparse.Namespace) -> int:
    import jax

    from jaxhybrid.parallel.tensor.mesh import factorizations
    from jaxhybrid.planner.hlo import async_overlap

    n = len(jax.devices())
    shapes = args.only or factorizations(n)
    if len(args.ladder_shape) != 1:
        raise ValueError(f"--ladder-shape takes one grid, got {len(args.ladder_shape)}")
    ladder_shape = args.ladder_shape[0]
    # Every grid is checked (device count, the model's divisibility) before the first one compiles.
    # Each grid named by the flag that gave it: the ladder's default 1,2,2,2 fails any --devices but 8.
    for flag, shape in [*(("--only", s) for s in shapes), ("--ladder-shape", ladder_shape)]:
        if math.prod(shape) != n:
            raise ValueError(f"{flag} grid {','.join(map(str, shape))} has {math.prod(shape)} devices, not the {n} "
                             f"JAX has (--devices sets the fake CPU devices); give {flag} a grid of {n}")
        _cfg(args, shape, "ABCDE")
    rows = []
    for shape in shapes:
        cfg, eng, text, step = _engine(args, shape, "ABCDE")
        t = _timed({"step": step}, args.steps, args.rounds)["step"]
        rows.append({"shape": dict(zip(("data", "depth", "row", "col"), shape)), "step_s": t,
                     **_bytes_report(eng, cfg, shape, text)})
        if not args.json:
            if len(rows) == 1:
                print(_ROW_HEAD, flush=True)
            print(_row_line(rows[-1]), flush=True)
    fns, overlap = {}, {}
    for letters in LADDER:
        _, _, text, step = _engine(args, ladder_shape, letters, remat="full")
        fns[letters or "baseline"] = step
        overlap[letters or "baseline"] = len([c for c in async_overlap(text) if c[1] > 0])
    times = _timed(fns, args.steps, args.rounds)
    base = times["baseline"]
    out = {"model": args.model, "layers": args.layers, "batch": args.batch, "seq": args.seq,
           "devices": n, "backend": jax.default_backend(), "factorizations": rows,
           "optimizations": {"shape": list(ladder_shape), "remat": "full",
                             "step_s": times, "speedup_vs_baseline": {k: base / v for k, v in times.items()},
                             "async_collectives_overlapping_compute": overlap}}
    if not args.json:
        print(_ladder_lines(out["optimizations"], jax.default_backend()), flush=True)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


_ROW_HEAD = (f"{'data':>4} {'dep':>3} {'row':>3} {'col':>3} {'step_ms':>9} {'dense_B':>10} {'eqs4-7_B':>10} "
             f"{'ratio':>6} {'data_B':>10} {'eq8_B':>10} {'relay_B':>9} {'other_B':>9}")


def _row_line(r: dict) -> str:
    """One factorization as a table row: collective bytes measured in the HLO beside AxoNN's equations."""
    s = r["shape"]
    pred = r["dense_tensor_axes_eqs_4_7"]
    ratio = f"{r['dense_tensor_axes_measured'] / pred:6.3f}" if pred else f"{'-':>6}"
    return (f"{s['data']:4d} {s['depth']:3d} {s['row']:3d} {s['col']:3d} {r['step_s'] * 1e3:9.3f} "
            f"{r['dense_tensor_axes_measured']:10d} {pred:10d} {ratio} {r['grad_allreduce_data_depth_measured']:10d} "
            f"{r['grad_allreduce_eq_8_dense_only']:10d} {r['relayout_without_A']:9d} {r['outside_eqs_4_8']:9d}")


def _ladder_lines(opt: dict, backend: str) -> str:
    """The A-E ladder as a table: step time, speedup over the baseline, async collectives overlapping compute."""
    lines = [f"optimizations on grid {','.join(map(str, opt['shape']))} (remat {opt['remat']}):",
             f"{'switches':>9} {'step_ms':>9} {'speedup':>8} {'overlapped':>10}"]
    for k, t in opt["step_s"].items():
        lines.append(f"{k:>9} {t * 1e3:9.3f} {opt['speedup_vs_baseline'][k]:8.3f} "
                     f"{opt['async_collectives_overlapping_compute'][k]:10d}")
    if backend == "cpu":
        lines.append("note: XLA:CPU runs collectives synchronously, so B-D overlap nothing here (column "
                     "'overlapped'); their rows differ by noise and compilation, not by overlap: measure them on GPUs")
    return "\n".join(lines)
