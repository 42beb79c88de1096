"""The process grid: MPI world -> (stage, replica) coordinates and the communicators of Myelin Fig. 2.

Ranks map to ``(stage, replica)`` by :class:`~jaxhybrid.core.layout.ParallelDims` (a pipeline row on
consecutive ranks, a data column strided by ``G_inter``). The pure part (that and :func:`partition_blocks`)
needs no MPI; :class:`Topology` adds the communicators, made collectively on every rank at start-up
(mpi4jax's lazy default communicator hangs if only some ranks create it):

- ``row``: the pipeline row (this replica's stages), used for control collectives such as the global
  gradient norm over stages;
- ``p2p``: a duplicate of ``row`` reserved for pipeline messages, so probes see nothing else;
- ``column``: the data column (this stage's replicas), used for the gradient all-reduce;
- ``world``: every rank, for overflow agreement (max) and aborts.
"""
from __future__ import annotations

from typing import Any

from jaxhybrid.core.config.schema import Config
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.parallel.pipeline.generators import rank_stages
from jaxhybrid.parallel.pipeline.schedule import configured_placement


def partition_blocks(n_layers: int, stages: int, partition: tuple[int, ...] | list[int] = ()
                     ) -> list[tuple[int, int]]:
    """Blocks ``[first, last)`` of each stage: an explicit list of counts, or an even split.

    The even split hands the remainder out one block each to the middle stages first, then to stage 0,
    then the last stage: the first stage also runs the embedding and the last the head and loss.
    Raises :class:`ConfigError` when there are more stages than blocks.
    """
    if stages < 1:
        raise ConfigError(f"parallel.pipeline={stages} must be >= 1")
    if stages > n_layers:
        raise ConfigError(f"parallel.pipeline={stages} stages exceed model.n_layers={n_layers} blocks; "
                          f"use at most {n_layers} stages")
    if partition:
        counts = [int(c) for c in partition]
        if len(counts) != stages or any(c < 1 for c in counts) or sum(counts) != n_layers:
            raise ConfigError(f"parallel.partition={counts} must have {stages} positive entries summing to "
                              f"model.n_layers={n_layers}")
    else:
        base, extra = divmod(n_layers, stages)
        # Middle stages first: stage 0 and the last stage also carry the embedding and the head.
        order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
        counts = [base] * stages
        for s in order[:extra]:
            counts[s] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


# Write ends of the launcher's ``.alive`` FIFOs held by this process (:meth:`Topology._record_pid`).
_ALIVE: dict[str, int] = {}


class Topology:
    """This rank's place in the grid and its communicators (collective construction on all ranks).

    Attributes:
      dims: the layout (:class:`~jaxhybrid.core.layout.ParallelDims`) whose grid this rank belongs to.
      rank, stage, replica: coordinates of this process (``stage``: its place in the pipeline row).
      stage_to_rank: the row rank of every logical stage (one per rank, or several: virtual stages placed
        by :func:`~jaxhybrid.parallel.pipeline.schedule.stage_placement`, or a MadPipe allocation's
        ``pipeline.stage_to_rank``; :func:`~jaxhybrid.parallel.pipeline.schedule.configured_placement`).
      stages: the logical stages this rank runs, lowest first; ``blocks``: ``(first, last)`` blocks of each;
        ``held``: every row rank's stages.
      world, row, p2p, column: mpi4py communicators (see module docstring).
    """

    def __init__(self, dims: ParallelDims, blocks: list[tuple[int, int]], comm: Any = None,
                 stage_to_rank: tuple[int, ...] | None = None):
        from mpi4py import MPI

        base = comm if comm is not None else MPI.COMM_WORLD
        dims.check_world(base.Get_size())
        self.dims = dims
        self.all_blocks = list(blocks)
        self.stage_to_rank = tuple(stage_to_rank) if stage_to_rank is not None else tuple(range(dims.pipeline))
        if len(self.stage_to_rank) != len(self.all_blocks):
            raise ValueError(f"{len(self.all_blocks)} block ranges for {len(self.stage_to_rank)} stages")
        self.world = base.Dup()
        self.rank = self.world.Get_rank()
        self.stage, self.replica = dims.coords(self.rank)
        self.held = rank_stages(self.stage_to_rank)  # each row rank's stages: a name is made per message
        self.stages = tuple(self.held[self.stage])
        self.blocks = {s: self.all_blocks[s] for s in self.stages}
        # Split is collective over world: every rank makes every split, in the same order.
        self.row = self.world.Split(color=self.replica, key=self.stage)
        self.p2p = self.row.Dup()
        self.column = self.world.Split(color=self.stage, key=self.replica)
        self._record_pid()

    def _record_pid(self) -> None:
        """Under ``jaxhybrid launch``, leave ``rank -> pid``, and a ``.exit`` marker when the interpreter
        exits normally, so that the launcher can name the first rank that ended abnormally (killed by a
        signal, or aborted: ``MPI_Abort`` skips Python's exit handlers), and hold the write end of the
        launcher's ``.alive`` FIFO until this process's files close (``commands/rankwatch.py``)."""
        import atexit
        import os

        pid_dir = os.environ.get("JAXHYBRID_PID_DIR")
        if pid_dir and os.path.isdir(pid_dir):
            base = os.path.join(pid_dir, f"rank{self.rank}")
            with open(base + ".pid", "w") as f:
                f.write(f"{os.getpid()} {self.who}")
            atexit.register(lambda: os.path.isdir(pid_dir) and open(base + ".exit", "w").close())
            if base not in _ALIVE and os.path.exists(base + ".alive"):
                try:  # never closed by us: the kernel closes it when the process ends, however it ends
                    _ALIVE[base] = os.open(base + ".alive", os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: the launcher's reader is gone; its PID watch still applies
                    pass

    @classmethod
    def from_config(cls, cfg: Config, comm: Any = None) -> "Topology":
        """Check the grid against the world size and the model before any communicator is made."""
        from mpi4py import MPI

        base = comm if comm is not None else MPI.COMM_WORLD
        dims, pl = cfg.layout, cfg.pipeline
        dims.check_world(base.Get_size())
        placed = configured_placement(pl, dims.pipeline)
        blocks = partition_blocks(cfg.model.n_layers, len(placed), cfg.parallel.partition)
        return cls(dims, blocks, base, placed)

    @property
    def who(self) -> str:
        """``rank r (stage i, replica j)`` (``stages i+k`` with virtual stages): how every message and the
        launcher's PID files name this rank."""
        return self.name(self.stage)

    def name(self, row_rank: int, replica: int | None = None) -> str:
        """How messages name the rank at ``row_rank`` of the pipeline row in ``replica`` (default: this
        rank's replica), with the stages it runs."""
        replica = self.replica if replica is None else replica
        held = self.held[row_rank]
        stages = f"stage {held[0]}" if len(held) == 1 else "stages " + "+".join(map(str, held))
        return f"rank {self.dims.rank(row_rank, replica)} ({stages}, replica {replica})"

    @property
    def num_stages(self) -> int:
        """Logical stages of the pipeline: ranks x virtual stages."""
        return len(self.stage_to_rank)

    @property
    def num_replicas(self) -> int:
        return self.dims.data

    def free(self) -> None:
        for c in (self.p2p, self.row, self.column, self.world):
            c.Free()
