"""``jaxhybrid bench offload --tensor DATA,DEPTH,ROW,COL``: the offloaded optimizer on a tensor mesh.

In one run, on the same model, batch and AdamW over the (data, depth, row, col) mesh: the on-device
update (``DeviceUpdater`` on the sharded fp32 parameters) and the per-device host offload
(``ShardedOffloadUpdater``: every device streams the buckets of the shards it owns), timed in
interleaved rounds. Device bytes are the peak over devices of the live arrays each device holds during
the optimizer phase, next to Myelin's per-device model (``20 phi`` against ``4 phi + 16 bsize`` with
``phi`` the parameters one device holds). On CPU host and device memory are the same RAM: the bytes are
what a GPU would hold, the times only show the cost of the extra copies.
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np

from jaxhybrid.runtime.host_alloc import default_cpu_devices


def _mesh(spec: str) -> tuple[int, int, int, int]:
    try:
        d, dep, r, c = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"--tensor {spec!r} must be DATA,DEPTH,ROW,COL (four integers)") from None
    if min(d, dep, r, c) < 1:
        raise ValueError(f"--tensor {spec!r}: every axis size must be >= 1")
    return d, dep, r, c


def prepare_tensor(args) -> None:
    """One fake CPU device per mesh position, unless ``XLA_FLAGS`` says otherwise."""
    d, dep, r, c = _mesh(args.tensor)
    default_cpu_devices(d * dep * r * c)


def run_tensor(args) -> int:
    d, dep, r, c = _mesh(args.tensor)
    import jax

    from jaxhybrid.optim import DeviceUpdater, build_transform, decay_mask
    from jaxhybrid.optim.memory_report import live_device_bytes, model_state_bytes, params_per_device
    from jaxhybrid.optim.sharded_offload import ShardedOffloadUpdater
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.engines.build import committed
    from jaxhybrid.runtime.engines.tensor import TensorEngine

    over = list(args.overrides) + ([f"model.name={args.model}"] if args.model else [])
    over += [f"precision.compute_dtype={args.compute_dtype}", f"parallel.data={d}", f"parallel.tensor_depth={dep}",
             f"parallel.tensor_row={r}", f"parallel.tensor_col={c}"]
    cfg = load_config(args.config, over)
    engine = TensorEngine(cfg.model, cfg)
    init = engine.init_params(jax.random.key(cfg.train.seed))
    phi = params_per_device(init)
    bsize = args.bucket_size or min(cfg.optim.bucket_size, max(phi // 16, 1))
    cfg = load_config(args.config, over + ["optim.offload=true", f"optim.bucket_size={bsize}"])
    tx = build_transform(cfg.optim, cfg.train.steps)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1)).astype(np.int32)
    lock = threading.Lock()

    def peak(run, others):
        held = live_device_bytes(exclude=others, per_device=True)
        with lock:
            run["peak"] = max(run["peak"], max(held.values(), default=0))

    dev, off = DeviceUpdater(tx, cfg.optim.grad_clip, decay_mask(cfg.optim)), ShardedOffloadUpdater(tx, cfg)
    runs = {"device": {"upd": dev, "params": jax.tree.map(lambda x: x.copy(), init), "peak": 0},
            "offload": {"upd": off, "params": init, "peak": 0}}
    for run in runs.values():
        # Committed as the trainer commits them (build.committed): an uncommitted optimizer state compiles
        # the update again on its second call, inside the first timed round (seen: baseline 0.69 s for 0.09).
        run["state"] = committed(run["upd"].init(run["params"]), like=run["params"])
        run["params"] = committed(run["upd"].compute_params(run["params"]))

    def step(name, probe=False):
        run = runs[name]
        upd = run["upd"]
        loss, g = engine.loss_and_grads(run["params"], batch, 1.0)
        sq, nf = upd.stats(g)
        if probe:  # the live-array walk is slow: only in an untimed step
            own = {id(x) for x in jax.tree.leaves((run["params"], run["state"], g))}
            others = {id(a) for a in jax.live_arrays()} - own
            if name == "device":
                peak(run, others)  # masters, Adam state and fp32 gradients are all live here
            for opt in getattr(upd, "opts", {}).values():
                opt.on_bucket = lambda i: peak(run, others)
        run["params"], run["state"], _ = upd.apply(run["params"], run["state"], g, 1.0, sq, nf)
        for opt in getattr(upd, "opts", {}).values():
            opt.on_bucket = None
        float(loss)

    for name in runs:
        step(name)  # compile
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name in runs:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - t0) / args.steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    for name in runs:
        step(name, probe=True)
    dt = cfg.precision.compute_dtype
    model_dev = model_state_bytes(phi, compute_dtype=dt)
    model_off = model_state_bytes(phi, compute_dtype=dt, offload=True, bucket_size=bsize)
    sizes = [opt.layout.n for opt in off.opts.values()]
    out = {"model": cfg.model.name, "mesh": {"data": d, "depth": dep, "row": r, "col": c},
           "params": int(off.gspec.n), "params_per_device": int(phi), "bucket_size": int(bsize),
           "host_elements_per_device": {"min": min(sizes), "max": max(sizes)}, "compute_dtype": dt,
           "device": jax.devices()[0].platform,
           "device_bytes_baseline": int(runs["device"]["peak"]), "device_bytes_offload": int(runs["offload"]["peak"]),
           "device_bytes_ratio": runs["offload"]["peak"] / max(runs["device"]["peak"], 1),
           "device_bytes_model_baseline": model_dev["device_total"],
           "device_bytes_model_offload": model_off["device_total"],
           "step_time_baseline_s": med["device"], "step_time_offload_s": med["offload"],
           "step_time_ratio": med["offload"] / med["device"]}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0
