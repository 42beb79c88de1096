"""The Myelin V-C coarsening sweep, one rank of ``mpirun -n 2 python -m mpi4py -m jaxhybrid.bench.offload_sweep``.

Each rank holds a flat gradient of ``--params`` elements (its replica's share) and a host-offloaded AdamW.
For k in 1, 2, 4, 8 it times (a) the all-reduce alone in chunks of ``k x bsize``, (b) the offloaded
optimizer alone on an already reduced gradient, and (c) the chunk-fed step, where a reduced chunk's k
buckets update before the rest is reduced. Rank 0 prints one JSON line; (c) below (a) + (b) would be
overlap (on CPU it was not: mpi4jax's all-reduce returns only when it is done). For a half-precision
``--dtype`` it also times (a) and (c) with the gradients on the wire as half precision (the sendrecvs of
``optim.allreduce_dtype: compute``, Myelin IV-B) against float32, side by side in the same rounds.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

KS = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--bucket-size", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()

    import jax.numpy as jnp
    import optax
    from mpi4py import MPI

    from jaxhybrid.optim.offload import DTYPES, OffloadedOptimizer
    from jaxhybrid.parallel.data.allreduce import iter_reduced_chunks

    world = MPI.COMM_WORLD
    comm = world.Split(0, world.rank)  # the data column, made on all ranks
    rng = np.random.default_rng(world.rank)
    params = {"w": jnp.asarray(rng.normal(size=a.params), jnp.float32)}
    grads = jnp.asarray(rng.normal(size=a.params) * 1e-3, DTYPES[a.dtype])
    opt = OffloadedOptimizer(optax.adamw(1e-4), a.bucket_size, compute_dtype=a.dtype, name="adamw")
    state = opt.init(params)
    flat = opt.device_params(state)

    box = {"state": state, "flat": flat}

    def opt_only(k):
        box["state"], box["flat"], _ = opt.step(box["state"], grads, box["flat"])

    def reduce_only(k, half=False):  # the chunks that (c) feeds the optimizer, drained
        for _, _, chunk in iter_reduced_chunks(grads, comm, k * a.bucket_size, half):
            chunk.block_until_ready()

    def both(k, half=False):
        chunks = iter_reduced_chunks(grads, comm, k * a.bucket_size, half)
        box["state"], box["flat"], _ = opt.step(box["state"], chunks=chunks, params=box["flat"])
        box["flat"].block_until_ready()

    kinds = {"optimizer": opt_only, "allreduce": reduce_only, "allreduce_optimizer": both}
    half = a.dtype != "float32"
    if half:
        kinds |= {"allreduce_half": lambda k: reduce_only(k, True), "allreduce_optimizer_half": lambda k: both(k, True)}
    times = {(name, k): [] for name in kinds for k in KS}
    for rep in range(a.reps + 1):  # rounds interleave every (kind, k) so machine noise hits all alike
        for (name, k) in times:
            comm.Barrier()
            t0 = time.perf_counter()
            kinds[name](k)
            if rep:  # round 0 compiles
                times[name, k].append(time.perf_counter() - t0)
    med = {key: float(np.median(v)) for key, v in times.items()}
    out = {"sweep_ranks": comm.Get_size(), "sweep_reps": a.reps,
           "optimizer_time_s": float(np.median([med["optimizer", k] for k in KS])),
           "allreduce_time_s": {str(k): med["allreduce", k] for k in KS},
           "allreduce_optimizer_time_s": {str(k): med["allreduce_optimizer", k] for k in KS}}
    if half:
        out |= {"allreduce_half_time_s": {str(k): med["allreduce_half", k] for k in KS},
                "allreduce_optimizer_half_time_s": {str(k): med["allreduce_optimizer_half", k] for k in KS},
                "allreduce_half_over_float32": {str(k): med["allreduce_half", k] / med["allreduce", k] for k in KS}}
    if world.rank == 0:
        print(json.dumps(out), flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
