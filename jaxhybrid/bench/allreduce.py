"""``jaxhybrid bench allreduce [--ranks N] [--sizes 1M,16M] [--json]``: the data column's gradient all-reduce,
``optim.allreduce_backend`` mpi (jitted mpi4jax over host-staged buffers) against xla (a psum over a JAX mesh
of the ranks' processes: gloo on CPU, NCCL on GPUs), side by side in one job.

Started as one process, it relaunches itself under the venv's ``mpiexec`` with ``N`` ranks (each pinned to
its share of the cores, as ``jaxhybrid launch`` runs them); the ranks join JAX's distributed runtime, so
both backends run in the same processes on the same vectors. Each size is reduced by both backends in
interleaved rounds (machine noise hits both alike) through the engine's entry points
(:func:`~jaxhybrid.parallel.data.allreduce.allreduce_tree` and
:meth:`~jaxhybrid.parallel.data.xla_allreduce.XlaColumn.allreduce_tree`, a one-leaf gradient pytree). A
reduction is timed from a barrier to the slowest rank's result being ready. Both results are checked equal
first. Printed JSON: per size ``mpi_s`` and ``xla_s`` (medians over rounds), ``xla_over_mpi`` (time ratio:
< 1 is xla faster) and each backend's bus bandwidth ``2 (N-1)/N x bytes / time`` in GB/s; and per size and
backend ``*_zero_s``, the sharded optimizer's reduce-scatter plus all-gather (``optim.shard_optimizer``),
with ``*_zero_over_allreduce``.

``vc`` (Myelin V-C, ``--vc-elements`` parameters): the host-offloaded AdamW step fed chunk by chunk by the
reduction (``iter_reduced_chunks``, chunks of ``--coarsening`` x ``--bucket-size``, reduced by a thread of
their own beside the updates as in training: ``reduced_beside``) against the same step
after the whole vector is reduced (reduction plus update apart), per backend: ``streamed_s``, ``apart_s``
and ``streamed_over_apart`` (< 1: the chunked reduction and the bucket updates overlap).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from jaxhybrid.bench import add_mpirun_arguments, relaunch
from jaxhybrid.core import launch_env
from jaxhybrid.core.argtypes import nonnegative_int, positive_int
from jaxhybrid.runtime import distributed

BACKENDS = ("mpi", "xla")


def elements(text: str) -> list[int]:
    """``1M,16M`` (K = 2^10, M = 2^20) -> element counts; ArgumentTypeError on anything else."""
    out = []
    for tok in filter(None, text.split(",")):
        scale = {"K": 1 << 10, "M": 1 << 20}.get(tok[-1].upper(), 1)
        digits = tok[:-1] if scale > 1 else tok
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"--sizes {text!r}: {tok!r} is not a positive count (e.g. 1M, 16M, 4096)")
        out.append(int(digits) * scale)
    if not out:
        raise argparse.ArgumentTypeError("--sizes needs at least one count")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=positive_int, default=2, help="data replicas (MPI ranks) reducing together")
    p.add_argument("--sizes", type=elements, default=elements("1M,16M"), help="gradient elements, comma-separated")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="gradient dtype (bfloat16 travels as float32, optim.allreduce_dtype=float32)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds, each running every size x backend")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed reductions first (compiling)")
    p.add_argument("--vc-elements", type=elements, default=elements("4M"),
                   help="parameters of the V-C overlap's offloaded step (one count)")
    p.add_argument("--bucket-size", type=positive_int, default=1 << 18, help="the V-C step's optim.bucket_size")
    p.add_argument("--coarsening", type=positive_int, default=2,
                   help="the V-C step's optim.allreduce_coarsening (buckets per reduced chunk)")
    add_mpirun_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise ValueError(f"--ranks {args.ranks}: an all-reduce needs at least 2 ranks")
    if args.worker:
        return _worker(args)
    return relaunch("allreduce", args.ranks, args, sys.argv[sys.argv.index("allreduce") + 1:]
                    if "allreduce" in sys.argv else [])


def _worker(args: argparse.Namespace) -> int:
    # Before any JAX computation; process index = MPI world rank, one GPU each.
    distributed.initialize(mesh_devices=launch_env.world_size())
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    from jaxhybrid.parallel.data.allreduce import all_gather, allreduce_tree, reduce_scatter
    from jaxhybrid.parallel.data.xla_allreduce import XlaColumn

    jax.devices()  # the backend starts collectively, on every process at once
    world = MPI.COMM_WORLD.Dup()
    rank, n = world.Get_rank(), world.Get_size()
    column = XlaColumn(list(range(n)), rank)
    dtype = jnp.dtype(args.dtype)
    chunk = 1 << 20  # validated only: the whole vector is one reduction on both paths
    reduce = {"mpi": lambda g: allreduce_tree(g, world, chunk), "xla": lambda g: column.allreduce_tree(g, chunk)}

    # ZeRO-1's two collectives on one flat vector (optim.shard_optimizer).
    zero = {"mpi": lambda g: all_gather(reduce_scatter(g["g"], world), world),
            "xla": lambda g: column.all_gather(column.reduce_scatter(g["g"]))}

    def timed(backend: str, grads, what=reduce) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(what[backend](grads))
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    vectors = {size: {"g": jax.device_put(jnp.arange(size, dtype=jnp.float32).astype(dtype) * (rank + 1) % 7,
                                          column.device)} for size in args.sizes}
    for size, g in vectors.items():  # same sums, then compile and warm both
        a, b = (np.asarray(reduce[k](g)["g"], np.float32) for k in BACKENDS)
        if not np.array_equal(a, b):
            raise AssertionError(f"{size} elements: mpi and xla sums differ (max |diff| {np.abs(a - b).max()})")
        for k in BACKENDS:  # the sharded path's sum, gathered back, is the all-reduce's
            z = np.asarray(zero[k](g), np.float32)[:size]
            if not np.allclose(z, a, rtol=1e-6, atol=0):
                raise AssertionError(f"{size} elements: {k}'s reduce-scatter + all-gather differs from the all-reduce")
        for _ in range(args.warmup):
            for k in BACKENDS:
                timed(k, g)
                timed(k, g, zero)
    times = {(size, k, z): [] for size in args.sizes for k in BACKENDS for z in (False, True)}
    for r in range(args.rounds):
        for size, g in vectors.items():
            for k in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):  # alternate who goes first
                times[size, k, False].append(timed(k, g))
                times[size, k, True].append(timed(k, g, zero))
    vc = _vc_overlap(args, world, column)
    if rank == 0:
        wire = 4  # float32 on both paths (bfloat16 is upcast)
        rows = []
        for size in args.sizes:
            med = {k: statistics.median(times[size, k, False]) for k in BACKENDS}
            zmed = {k: statistics.median(times[size, k, True]) for k in BACKENDS}
            bus = 2 * (n - 1) / n * size * wire / 1e9
            rows.append({"elements": size, "mpi_s": round(med["mpi"], 6), "xla_s": round(med["xla"], 6),
                         "xla_over_mpi": round(med["xla"] / med["mpi"], 3),
                         "mpi_busbw_GBps": round(bus / med["mpi"], 3), "xla_busbw_GBps": round(bus / med["xla"], 3),
                         **{f"{k}_zero_s": round(zmed[k], 6) for k in BACKENDS},
                         **{f"{k}_zero_over_allreduce": round(zmed[k] / med[k], 3) for k in BACKENDS}})
        out = {"ranks": n, "dtype": args.dtype, "rounds": args.rounds, "platform": jax.devices()[0].platform,
               "results": rows, "vc": vc}
        if not args.json:
            for row in rows:
                print(f"{row['elements']:>10} elements: mpi {row['mpi_s'] * 1e3:8.2f} ms  xla {row['xla_s'] * 1e3:8.2f} "
                      f"ms  xla/mpi {row['xla_over_mpi']:.3f}", file=sys.stderr)
        print(json.dumps(out), flush=True)
    world.Free()
    return 0


def _vc_overlap(args: argparse.Namespace, world, column) -> dict:
    """Myelin V-C per backend (module docstring): medians over ``args.rounds`` of the offloaded step fed by
    the chunked reduction and of the whole reduction followed by the same step, timed to the slowest rank."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from mpi4py import MPI

    from jaxhybrid.optim.offload import OffloadedOptimizer
    from jaxhybrid.parallel.data.allreduce import allreduce_tree, iter_reduced_chunks, reduced_beside

    size, rank = args.vc_elements[0], world.Get_rank()
    opt = OffloadedOptimizer(optax.adamw(1e-3), args.bucket_size, device=column.device)
    state = opt.init({"w": np.linspace(-1, 1, size, dtype=np.float32)})
    grads = jax.device_put(jnp.linspace(0, 1, size, dtype=jnp.float32) * (rank + 1), column.device)
    chunk = args.bucket_size * args.coarsening
    # As the pipeline engine feeds the trainer: the reductions in a thread of their own, beside the updates.
    chunks = {"mpi": lambda g: reduced_beside(iter_reduced_chunks(g, world, chunk, ahead=False)),
              "xla": lambda g: reduced_beside(column.iter_reduced_chunks(g, chunk, ahead=False))}
    whole = {"mpi": lambda g: allreduce_tree(g, world, chunk), "xla": lambda g: column.allreduce_tree(g, chunk)}
    ways = {"streamed": lambda k: opt.step(state, chunks=chunks[k](grads)),
            "apart": lambda k: opt.step(state, grads=whole[k](grads))}

    def timed(k: str, way: str) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(ways[way](k)[1])
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    times = {(k, w): [] for k in BACKENDS for w in ways}
    for r in range(args.warmup + args.rounds):
        for k in BACKENDS:
            for w in (("streamed", "apart") if r % 2 == 0 else ("apart", "streamed")):
                t = timed(k, w)
                if r >= args.warmup:
                    times[k, w].append(t)
    out = {"elements": size, "bucket_size": args.bucket_size, "coarsening": args.coarsening}
    for k in BACKENDS:
        s, a = (statistics.median(times[k, w]) for w in ("streamed", "apart"))
        out[k] = {"streamed_s": round(s, 6), "apart_s": round(a, 6), "streamed_over_apart": round(s / a, 3)}
    return out
