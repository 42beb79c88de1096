"""A stage's data replicas (Myelin's column, Fig. 2) as the sharded optimizer sees them: its size, this
replica's place in it, and ZeRO-1's two collectives on the configured backend (``optim.allreduce_backend``:
mpi4jax over the column's communicator, or XLA collectives over its JAX mesh).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import jax

from jaxhybrid.parallel.data import allreduce
from jaxhybrid.parallel.data.xla_allreduce import XlaColumn


class ReplicaColumn:
    """Args:
      comm: the column's mpi4py communicator (rank = replica index); scalars are always summed over it.
      xla: the column's :class:`~jaxhybrid.parallel.data.xla_allreduce.XlaColumn` with
        ``optim.allreduce_backend: xla``, else None (mpi4jax).
      watch: ``watch(what)`` is a context manager around each collective (the engine's watchdog, so a
        replica that died ends the job instead of leaving its peers in the reduction).
    """

    def __init__(self, comm: Any, xla: XlaColumn | None = None,
                 watch: Callable[[str], ContextManager] | None = None):
        self.comm, self.xla = comm, xla
        self.size, self.index = comm.Get_size(), comm.Get_rank()
        self._watch = watch or (lambda what: contextlib.nullcontext())

    def shard_length(self, n: int) -> int:
        return allreduce.shard_length(n, self.size)

    def reduce_scatter(self, flat: jax.Array, half_wire: bool = False) -> jax.Array:
        """This replica's shard of ``flat`` summed over the column (``optim.allreduce_dtype: compute``:
        half-precision vectors travel as they are)."""
        with self._watch("reduce-scatter of the gradients over the data replicas"):
            if self.xla is not None:
                return self.xla.reduce_scatter(flat, half_wire)
            return allreduce.reduce_scatter(flat, self.comm, half_wire)

    def all_gather(self, shard: jax.Array, n: int) -> jax.Array:
        """The column's shards in replica order, the padding past ``n`` cut off."""
        with self._watch("all-gather of the updated parameters over the data replicas"):
            whole = self.xla.all_gather(shard) if self.xla is not None else allreduce.all_gather(shard, self.comm)
            return whole[:n] if whole.shape[0] != n else whole

    def sum(self, value: float) -> float:
        """A host scalar summed over the column."""
        with self._watch("sum over the data replicas (gradient norm)"):
            return float(self.comm.allreduce(float(value)))


__all__ = ["ReplicaColumn"]
