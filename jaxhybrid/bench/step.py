"""``jaxhybrid bench step``: the trainer's step against a plain ``jit(value_and_grad)`` + optax step.

Both run the same model, batch and AdamW settings in one process; timings interleave in rounds so
machine noise hits both alike. Prints JSON with ``ratio`` = plain step time / trainer step time
(goal >= 0.97: the trainer's engine/updater split costs nothing measurable), ``ratio_rounds``, the
per-round ratio's range (its noise band), and ``plain_compiles`` (1 when no timed round compiled).
It neither reads nor writes ``run.dir``.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax

from jaxhybrid.bench import round_ratios
from jaxhybrid.optim import build_transform, decay_mask
from jaxhybrid.optim.updater import decay_view
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.build import committed
from jaxhybrid.runtime.trainer import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="run config YAML (default: the config defaults, gpt-tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override as in train (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of both steps (the median of each is compared)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.rounds < 1:
        raise ValueError(f"--steps {args.steps} and --rounds {args.rounds} must be >= 1")
    cfg = load_config(args.config, ["metrics.progress=false", "metrics.tensorboard=false"] + args.overrides)
    if cfg.world_size > 1:  # the trainer's check would say "launch with -n", which does not run a benchmark
        p = cfg.parallel
        raise ValueError(f"bench step times one process's trainer, but parallel.pipeline({p.pipeline}) x "
                         f"parallel.data({p.data}) = {cfg.world_size} is a job of MPI ranks: time pipelines with "
                         f"`jaxhybrid bench pipeline`, or set pipeline=1 and data=1 (or parallel.mesh_data=true)")
    trainer = Trainer(cfg, writes_run_dir=False)  # times steps only: run.dir is neither read nor written
    model, transform = trainer.model, build_transform(cfg.optim, cfg.train.steps)
    decay = decay_mask(cfg.optim)

    @jax.jit
    def plain(params, opt_state, batch):
        loss, g = jax.value_and_grad(model.loss)(params, batch[:, :-1], batch[:, 1:])
        g = optax.clip_by_global_norm(cfg.optim.grad_clip).update(g, optax.EmptyState())[0] \
            if cfg.optim.grad_clip > 0 else g
        upd, opt_state = transform.update(g, opt_state, decay_view(params, decay))
        return optax.apply_updates(params, upd), opt_state, loss

    st = trainer.init_state()
    # Copies (the trainer donates its params to the update), committed as the trainer's are: the jit
    # cache keys on committedness, and the plain step's outputs are committed, so uncommitted inputs
    # would compile it again inside the first timed round (seen: ratio 18 instead of about 1).
    pp = committed(jax.tree.map(lambda x: x.copy(), st.params))
    ps = committed(transform.init(pp), like=pp)
    batches = [np.asarray(trainer.sampler.batch(i), np.int32) for i in range(args.steps)]
    # Warm up (compile) both.
    st, _ = trainer.step(st)
    pp, ps, l = plain(pp, ps, batches[0])
    float(l)

    def run_trainer():
        nonlocal st
        for i in range(args.steps):
            st, _ = trainer.step(st)

    def run_plain():
        nonlocal pp, ps
        for i in range(args.steps):
            pp, ps, loss = plain(pp, ps, batches[i])
            float(loss)  # the trainer reads its loss every step too

    runs = {"trainer": run_trainer, "plain": run_plain}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        # Alternate which goes first, so a burst of machine noise or a warm cache favours neither.
        for name in (("trainer", "plain") if r % 2 == 0 else ("plain", "trainer")):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - t0) / args.steps)
    tt, tp = float(np.median(times["trainer"])), float(np.median(times["plain"]))
    out = {"model": cfg.model.name, "global_batch": cfg.train.global_batch, "seq_len": cfg.data.seq_len,
           "trainer_step_s": tt, "plain_step_s": tp, "ratio": tp / tt, "goal": 0.97,
           "ratio_rounds": round_ratios(times["plain"], times["trainer"]), "rounds": args.rounds,
           "plain_compiles": plain._cache_size(),  # 1: no round timed a compile
           "device": jax.devices()[0].platform}
    print(json.dumps(out))
    return 0
