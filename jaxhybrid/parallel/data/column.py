"""A stage's data replicas (Myelin's column, Fig. 2) as the sharded optimizer sees them: its size, this
replica's place in it, and ZeRO-1's two collectives on the configured backend (``optim.allreduce_backend``:
mpi4jax over the column's communicator, or XLA collectives over its JAX mesh).
"""
from __future__ import annotations

import contextlib
import time
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
      recording: ``recording()`` is where a traced step records each collective (``record(name, kind,
        start, end)``, kind ``"reduce"``, waited for), or None in a step that is not traced.
    """

    def __init__(self, comm: Any, xla: XlaColumn | None = None,
                 watch: Callable[[str], ContextManager] | None = None,
                 recording: Callable[[], Callable | None] | None = None):
        self.comm, self.xla = comm, xla
        self.size, self.index = comm.Get_size(), comm.Get_rank()
        self._watch = watch or (lambda what: contextlib.nullcontext())
        self._recording = recording or (lambda: None)

    def _traced(self, name: str, out: jax.Array, t0: float) -> jax.Array:
        record = self._recording()
        if record is not None:
            jax.block_until_ready(out)
            record(name, "reduce", t0, time.perf_counter())
        return out

    def shard_length(self, n: int) -> int:
        return allreduce.shard_length(n, self.size)

    def reduce_scatter(self, flat: jax.Array, half_wire: bool = False) -> jax.Array:
        """This replica's shard of ``flat`` summed over the column (``optim.allreduce_dtype: compute``:
        half-precision vectors travel as they are)."""
        with self._watch("reduce-scatter of the gradients over the data replicas"):
            t0 = time.perf_counter()
            out = (self.xla.reduce_scatter(flat, half_wire) if self.xla is not None
                   else allreduce.reduce_scatter(flat, self.comm, half_wire))
            return self._traced("reduce-scatter", out, t0)

    def all_gather(self, shard: jax.Array, n: int) -> jax.Array:
        """The column's shards in replica order, the padding past ``n`` cut off."""
        with self._watch("all-gather of the updated parameters over the data replicas"):
            t0 = time.perf_counter()
            whole = self.xla.all_gather(shard) if self.xla is not None else allreduce.all_gather(shard, self.comm)
            return self._traced("all-gather", whole[:n] if whole.shape[0] != n else whole, t0)

    def sum(self, value: float) -> float:
        """A host scalar summed over the column."""
        with self._watch("sum over the data replicas (gradient norm)"):
            return float(self.comm.allreduce(float(value)))


__all__ = ["ReplicaColumn"]
