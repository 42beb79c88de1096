"""``jaxhybrid bench offload``: host-offloaded optimizer against the on-device mixed-precision step.

In one run, on the same model, batch and AdamW: (1) the non-offloaded step (fp32 masters, optax on the
device, ``DeviceUpdater``) and (2) the offloaded step (compute-dtype params and gradients as flat device
vectors, masters and Adam state on host in buckets, Myelin V-B), timed in interleaved rounds; device
bytes measured as the peak of live device arrays during each optimizer phase, next to Myelin's model
(``20 phi`` vs ``4 phi + 16 bsize``); both host stores timed; (3) the same offloaded step through the
trainer's own path (``OffloadUpdater.apply`` on the params and gradient pytrees, ``*_trainer`` keys; the
goal holds only if both meet it); and (4) the V-C sweep: ``mpirun -n 2``
runs the chunk-fed offloaded step (all-reduce chunks of ``k x bsize``) for k in 1, 2, 4, 8, beside the
all-reduce alone and the optimizer alone. Prints one JSON object. ``--tensor`` runs the tensor-mesh
variant instead (:mod:`jaxhybrid.bench.offload_tensor`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxhybrid.bench import round_ratios
from jaxhybrid.bench.offload_tensor import prepare_tensor, run_tensor
from jaxhybrid.cli.commands.launch import find_mpiexec, job_cpus, rank_environment
from jaxhybrid.core.argtypes import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="run config YAML (default: built-in defaults)")
    p.add_argument("--model", default=None, help="model preset (overrides the config's model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override as in train (repeatable)")
    p.add_argument("--compute-dtype", default="bfloat16", help="Myelin's 4 phi assumes half precision")
    p.add_argument("--bucket-size", type=int, default=0,
                   help="elements per bucket; 0 = optim.bucket_size, capped at params // 16")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds")
    p.add_argument("--no-sweep", action="store_true", help="skip the mpirun -n 2 k sweep")
    p.add_argument("--tensor", default=None, metavar="DATA,DEPTH,ROW,COL",
                   help="instead: the per-device offload on this tensor mesh against the on-device update")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def _others(own) -> set:
    """Ids of live device arrays that are not this path's own persistent state (excluded from its peak)."""
    import jax

    mine = {id(x) for x in jax.tree.leaves(own)}
    return {id(a) for a in jax.live_arrays()} - mine


def _peak(probe: list, others: set) -> None:
    from jaxhybrid.optim.memory_report import live_device_bytes

    probe[0] = max(probe[0], live_device_bytes(exclude=others))


def prepare(args: argparse.Namespace) -> None:
    if args.tensor:
        prepare_tensor(args)


def run(args: argparse.Namespace) -> int:
    if args.tensor:
        return run_tensor(args)
    import jax
    import jax.numpy as jnp

    from jaxhybrid.model import Model, compiled_init
    from jaxhybrid.optim import DeviceUpdater, build_transform, decay_mask
    from jaxhybrid.optim.memory_report import model_state_bytes
    from jaxhybrid.optim.offload import OffloadedOptimizer
    from jaxhybrid.optim.offload_updater import OffloadUpdater
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.engines.base import LocalEngine
    from jaxhybrid.runtime.engines.build import committed

    over = list(args.overrides) + ([f"model.name={args.model}"] if args.model else [])
    cfg = load_config(args.config, over + [f"precision.compute_dtype={args.compute_dtype}"])
    model = Model(cfg.model, compute_dtype=cfg.precision.compute_dtype)
    engine = LocalEngine(model, cfg.pipeline.microbatches)
    params = compiled_init(model, jax.random.key(cfg.train.seed))
    n = sum(x.size for x in jax.tree.leaves(params))
    bsize = args.bucket_size or min(cfg.optim.bucket_size, max(n // 16, 1))
    tx = build_transform(cfg.optim, cfg.train.steps)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1)).astype(np.int32)

    dev = DeviceUpdater(tx, cfg.optim.grad_clip, decay_mask(cfg.optim))
    base = {"params": jax.tree.map(jnp.array, params)}
    base["state"] = dev.init(base["params"])
    base_peak = [0]

    def baseline_step(probe=False):
        others = _others(base) if probe else None
        loss, g = engine.loss_and_grads(base["params"], batch, 1.0)
        sq, nf = dev.stats(g)
        if probe:
            _peak(base_peak, others)  # masters + Adam state + fp32 gradients are all live here
        base["params"], base["state"], _ = dev.apply(base["params"], base["state"], g, 1.0, sq, nf)
        float(loss)

    opts = {b: OffloadedOptimizer(tx, bsize, grad_clip=cfg.optim.grad_clip,
                                  compute_dtype=cfg.precision.compute_dtype, backend=b, name="adamw",
                                  decay=decay_mask(cfg.optim))
            for b in ("numpy", "pinned_host")}
    runs = {}
    for name, opt in opts.items():
        st = opt.init(params)
        runs[name] = {"opt": opt, "state": st, "flat": opt.device_params(st), "peak": [0]}

    def offload_step(name, probe=False):
        r = runs[name]
        opt = r["opt"]
        if probe:  # the live-array walk is slow: only in the untimed probe step
            r["others"] = _others(r["flat"])
            opt.on_bucket = lambda i: _peak(r["peak"], r["others"])
        tree = opt.params_tree(r["flat"])
        loss, g = engine.loss_and_grads(tree, batch, 1.0)
        del tree  # an engine fed flat parameters holds no pytree copy during the optimizer phase
        flat_g = opt.flatten(g)
        sq = jnp.sum(jnp.square(flat_g.astype(jnp.float32)))
        del g
        r["state"], r["flat"], _ = opt.step(r["state"], flat_g, r["flat"], sq=sq)
        opt.on_bucket = None
        float(loss)

    # The trainer's path (``OffloadUpdater.apply``, as ``Trainer.step`` calls it): the engine takes the
    # params pytree and the updater gets that pytree and the gradient pytree.
    upd = OffloadUpdater(tx, load_config(args.config, over + [f"precision.compute_dtype={args.compute_dtype}",
                                                               "optim.offload=true", f"optim.bucket_size={bsize}"]))
    trainer = {"state": upd.init(params), "peak": [0]}
    # Committed as Trainer.init_state commits them: uncommitted, step 2 compiled `_stats` and a cast again,
    # inside the first timed round.
    trainer["params"] = committed(upd.compute_params(params))

    def trainer_step(probe=False):
        if probe:
            others = _others((trainer["params"], trainer["state"]))
            upd.opt.on_bucket = lambda i: _peak(trainer["peak"], others)
        loss, g = engine.loss_and_grads(trainer["params"], batch, 1.0)
        sq, nf = upd.stats(g)
        trainer["params"], trainer["state"], _ = upd.apply(trainer["params"], trainer["state"], g, 1.0, sq, nf)
        upd.opt.on_bucket = None
        float(loss)

    main_backend = OffloadedOptimizer(tx, bsize, name="adamw").store.name
    baseline_step()
    for name in runs:
        offload_step(name)  # compile
    trainer_step()
    times = {"baseline": [], **{k: [] for k in runs}, "trainer": []}
    for _ in range(args.rounds):
        for key in times:
            fn = {"baseline": baseline_step, "trainer": trainer_step}.get(key, lambda k=key: offload_step(k))
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[key].append((time.perf_counter() - t0) / args.steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    baseline_step(probe=True)  # untimed steps with a live-array probe (after every bucket for offload)
    for name in runs:
        offload_step(name, probe=True)
    trainer_step(probe=True)
    model_base = model_state_bytes(n, compute_dtype=cfg.precision.compute_dtype)
    model_off = model_state_bytes(n, compute_dtype=cfg.precision.compute_dtype, offload=True, bucket_size=bsize)
    goal_bytes = (4 * n + 16 * bsize) * 1.05
    out = {"model": cfg.model.name, "params": int(n), "bucket_size": int(bsize), "buckets": -(-n // bsize),
           "compute_dtype": cfg.precision.compute_dtype, "device": jax.devices()[0].platform,
           "host_backend": main_backend,
           "device_bytes_baseline": int(base_peak[0]), "device_bytes_offload": int(runs[main_backend]["peak"][0]),
           "device_bytes_model_baseline": model_base["device_total"],
           "device_bytes_model_offload": model_off["device_total"], "host_bytes_offload": model_off["host_total"],
           "goal_device_bytes": goal_bytes,
           "device_bytes_offload_trainer": int(trainer["peak"][0]),
           "device_bytes_goal_met": max(runs[main_backend]["peak"][0], trainer["peak"][0]) <= goal_bytes,
           "step_time_baseline_s": med["baseline"], "step_time_offload_s": med[main_backend],
           "step_time_ratio": med[main_backend] / med["baseline"], "step_time_goal": 1.2,
           "step_time_offload_trainer_s": med["trainer"], "step_time_ratio_trainer": med["trainer"] / med["baseline"],
           "step_time_ratio_trainer_rounds": round_ratios(times["trainer"], times["baseline"]),
           "host_backend_step_s": {k: med[k] for k in runs},
           "host_backend_device_bytes": {k: int(r["peak"][0]) for k, r in runs.items()}}
    if not args.no_sweep:
        out.update(_sweep(n, bsize, cfg.precision.compute_dtype))
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


def _sweep(n: int, bsize: int, dtype: str) -> dict:
    root = Path(__file__).resolve().parents[2]
    # The launcher's per-rank settings: threads sized to cores / ranks, a timeout, CPU-only.
    # (Not pinned: its ranks run jaxhybrid.bench.offload_sweep, not the CLI that pins them.)
    env = dict(rank_environment(2, job_cpus(), 300, bind=False), JAX_PLATFORMS="cpu")
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "jaxhybrid.bench.offload_sweep",
           "--params", str(n), "--bucket-size", str(bsize), "--dtype", dtype]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=330)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"k sweep under mpirun failed (rc={res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return json.loads(lines[-1])
