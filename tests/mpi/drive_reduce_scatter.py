"""MPI driver of the reduce-scatter on gloo (run by tests/mpi/test_mpi_pipeline.py under ``mpirun -n 2
python -m mpi4py`` with 2 fake CPU devices per rank): every rank joins JAX's distributed runtime, so
XLA:CPU runs its collectives through gloo, whose own reduce-scatter sometimes gives rank 0 of a group
wrong values at the end of a chunk of more than a few hundred KiB (jaxhybrid.parallel.collectives).

``--rounds`` times, on 8M-element float32 vectors (32 MiB chunks):
- ``column``: a data column over the 2 processes (``XlaColumn.reduce_scatter``, ZeRO-1 on the xla backend);
- ``local``: a mesh of one process's 2 devices (a hybrid rank's tensor mesh, as ``Linear3D``'s dW over depth);
each result must equal the sum exactly (small integers). ``--raw`` uses ``lax.psum_scatter`` itself, to
show what the test catches. Rank 0 prints ``REDUCE_SCATTER <case> ok``; a mismatch ends the job.
"""
from __future__ import annotations

import argparse

from jaxhybrid.runtime import distributed

distributed.initialize()  # before any JAX computation: gloo for every collective of this process
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jaxhybrid.parallel import collectives  # noqa: E402
from jaxhybrid.parallel.data.xla_allreduce import XlaColumn  # noqa: E402

N = 1 << 23


def pattern(k: int) -> np.ndarray:
    """Replica ``k``'s vector: small integers, so every sum is exact in float32."""
    return (np.arange(N, dtype=np.float32) * (k + 1)) % 7


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--raw", action="store_true")
    args = p.parse_args()
    if args.raw:
        collectives.gloo_collectives = lambda: False
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    whole = pattern(0) + pattern(1)

    column = XlaColumn(list(range(n)), rank)
    g = jax.device_put(jnp.asarray(pattern(rank)), column.device)
    c = N // n
    for i in range(args.rounds):
        got = np.asarray(column.reduce_scatter(g))
        assert np.array_equal(got, whole[rank * c:(rank + 1) * c]), f"column, round {i}, rank {rank}"
    if rank == 0:
        print("REDUCE_SCATTER column ok", flush=True)

    mesh = Mesh(np.array(jax.local_devices()[:2]), ("depth",))
    rows = jax.device_put(jnp.asarray(np.stack([pattern(0), pattern(1)])),
                          jax.sharding.NamedSharding(mesh, P("depth")))
    scatter = jax.jit(jax.shard_map(lambda r: collectives.psum_scatter(r[0], "depth"), mesh=mesh,
                                    in_specs=P("depth"), out_specs=P("depth")))
    for i in range(args.rounds):
        got = np.asarray(scatter(rows))
        assert np.array_equal(got, whole), f"local mesh, round {i}, rank {rank}"
    if rank == 0:
        print("REDUCE_SCATTER local ok", flush=True)


if __name__ == "__main__":
    main()
