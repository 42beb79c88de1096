"""MPI fault driver (tests/mpi/test_mpi_pipeline.py): a 2-stage pipeline (x ``--data`` replicas) where
rank ``--victim`` (default 1) fails at step 1.

``--mode exception``: its forward raises; ``kill``: it SIGKILLs itself; ``hang``: its forward sleeps
forever (the watchdog, deadline ``--deadline`` seconds, must end the job); ``hang-collective``: it
finishes the step, then sleeps forever while its peers wait for it in the trainer's collectives after
the step (``global_sum``, ``global_max``), where no pipeline phase arms the watchdog. Step 0 runs
normally first so compilation is not mistaken for a hang. The faulty rank writes the wall time of the
fault to ``--stamp`` so the test can measure how long the job took to end.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import jax
import numpy as np
from mpi4py import MPI

from jaxhybrid.model import Model
from jaxhybrid.parallel.pipeline.topology import Topology
from jaxhybrid.runtime.config_load import config_from_dict
from jaxhybrid.runtime.engines.pipeline import PipelineEngine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("exception", "kill", "hang", "hang-collective", "none"), required=True)
    ap.add_argument("--deadline", type=float, default=2.0)
    ap.add_argument("--stamp", required=True)
    ap.add_argument("--data", type=int, default=1)
    ap.add_argument("--victim", type=int, default=1)
    a = ap.parse_args()
    cfg = config_from_dict({
        "model": {"name": "gpt-tiny", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                  "max_seq_len": 16},
        "data": {"seq_len": 8}, "train": {"global_batch": 4 * a.data},
        "parallel": {"pipeline": 2, "data": a.data}, "pipeline": {"schedule": "1f1b", "microbatches": 2}})
    engine = PipelineEngine(cfg, Model(cfg.model), Topology.from_config(cfg))
    params = engine.init_params(jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, 64, (4 * a.data, 9)).astype(np.int32)
    # Step 0, as the trainer runs it (its phase and collectives): the first time each is armed it has
    # pipeline.watchdog_compile_s, for compiling; after that the deadline under test.
    engine.loss_and_grads(params, batch, 1.0)
    engine.global_sum(engine.global_max(0.0))
    engine.watchdog.deadline_s = a.deadline
    MPI.COMM_WORLD.Barrier()
    if a.mode == "hang-collective":
        engine.loss_and_grads(params, batch, 1.0)
        if engine.rank == a.victim:
            with open(a.stamp, "w") as f:
                f.write(repr(time.time()))
            time.sleep(3600)
        engine.global_sum(engine.global_max(0.0))
        print(f"rank {engine.rank}: collectives finished", flush=True)
        return 0
    if engine.rank == a.victim and a.mode != "none":
        with open(a.stamp, "w") as f:
            f.write(repr(time.time()))
        if a.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

        def broken(*args, **kw):
            if a.mode == "hang":
                time.sleep(3600)
            raise RuntimeError("injected failure in forward")

        engine.stage.forward = broken
    engine.loss_and_grads(params, batch, 1.0)
    print(f"rank {engine.rank}: step 1 finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
