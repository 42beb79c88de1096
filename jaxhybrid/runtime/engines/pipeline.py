"""``PipelineEngine``: the :class:`~jaxhybrid.runtime.engines.base.GradEngine` of one rank of a Myelin grid.

Myelin Alg. 1 from the point of view of rank ``(stage i, replica j)``: slice this replica's shard of the
global batch into microbatches (line 5), run the pipeline phase with the event loop (line 12, Alg. 2 or
any static schedule), sum the tied-embedding gradient between the first and last stage, all-reduce the
stage's gradients over the data column in buckets (line 13). The trainer then runs the optimizer.

Everything that can be wrong with the input (grid vs world size, stages vs blocks, microbatches vs
schedule) is checked in the constructor before any compilation, by pure code, so every rank raises the
same message.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.core.config.schema import Config
from jaxhybrid.model import Model
from jaxhybrid.parallel.data.allreduce import EarlyColumnSum, allreduce_tree, iter_reduced_chunks, reduced_beside
from jaxhybrid.parallel.data.column import ReplicaColumn
from jaxhybrid.parallel.data.flat import release
from jaxhybrid.parallel.data.xla_allreduce import XlaColumn
from jaxhybrid.parallel.pipeline import tied
from jaxhybrid.parallel.pipeline.dispatch import synced_dispatch
from jaxhybrid.parallel.pipeline.event_loop import EventLoop, loop_policy
from jaxhybrid.parallel.pipeline.mpi4py_transport import Mpi4pyTransport
from jaxhybrid.parallel.pipeline.mpi_transport import Mpi4jaxTransport
from jaxhybrid.parallel.pipeline.schedule import configured_schedule
from jaxhybrid.parallel.pipeline.trace import Event, write_measured
from jaxhybrid.parallel.pipeline.transfer_transport import TransferTransport
from jaxhybrid.parallel.pipeline.transport import InProcessHub
from jaxhybrid.parallel.pipeline.watchdog import Watchdog, install_abort_on_exception
from jaxhybrid.parallel.tensor.local import LocalTensor
from jaxhybrid.parallel.twobp.stage import Stage, weight_join
from jaxhybrid.runtime.engines.base import GradEngine, split_batch


class PipelineEngine(GradEngine):
    """One rank of a ``G_inter x G_data`` pipeline (``mpirun -n G_inter*G_data jaxhybrid train``).

    A rank runs one stage, or with ``pipeline.virtual_stages`` v > 1 several (Megatron-LM's interleaving,
    ZB-V's V shape): its parameters, gradients, optimizer state and checkpoints are then one dict of all its
    stages' parts, whose keys are disjoint (``embed``, ``block_<i>`` by model block, ``head``).

    Args:
      cfg: the run configuration (``parallel``, ``pipeline``, ``train.remat``, ``optim.bucket_size``).
      model: the whole :class:`~jaxhybrid.model.Model` (this rank builds the stages it runs).
      topology: this rank's :class:`~jaxhybrid.parallel.pipeline.topology.Topology`.
      abort_on_error: install the excepthook that aborts the MPI job on any uncaught exception.
      stage: an existing Stage (or ``{stage index: Stage}``) for this rank's blocks, to reuse its compiled
        kernels (sweeps, benches).
    """

    def __init__(self, cfg: Config, model: Model, topology: Any, abort_on_error: bool = True, stage: Any = None):
        pl = cfg.pipeline
        self.cfg, self.model, self.topo = cfg, model, topology
        self.rank, self.stage_index, self.replica = topology.rank, topology.stage, topology.replica
        self.num_stages, self.replicas = topology.num_stages, topology.num_replicas
        self.microbatches = pl.microbatches
        self.ranks = topology.dims.pipeline
        # Pure checks first: a bad schedule/microbatch count raises the same ValueError on every rank.
        self.schedule = configured_schedule(pl, self.ranks)
        self.who = topology.who
        if abort_on_error:
            install_abort_on_exception(self.who, topology.world)
        # Myelin V-A: with full remat and no explicit interval, the stage picks the optimal one.
        interval = cfg.train.checkpoint_interval if cfg.train.remat == "full" else 0
        # Hybrid pipeline x tensor (AxoNN-4D Sec. V): this rank's stages run on its local tensor mesh, with
        # the tensor ops injected into the (unchanged) model; checks the layout before any compile.
        self.local = None
        stage_model = model
        if cfg.tensor_size > 1:
            self.local = LocalTensor.from_config(cfg)
            stage_model = dataclasses.replace(model, ops=self.local.ops)
        given = stage if isinstance(stage, dict) else {} if stage is None else {topology.stages[0]: stage}
        self.stages = {}
        for s in topology.stages:
            first, last = topology.blocks[s]
            st = given.get(s)
            if st is not None and (st.first_block, st.last_block) != (first, last):
                raise ValueError(f"{self.who}: the given stage runs blocks [{st.first_block}, {st.last_block}), "
                                 f"the topology assigns stage {s} [{first}, {last})")
            self.stages[s] = st or Stage(stage_model, first, last, num_stages_hint=self.num_stages,
                                         remat=cfg.train.remat, checkpoint_interval=interval)
        mb = cfg.microbatch_size
        template = jax.ShapeDtypeStruct((mb, cfg.data.seq_len, cfg.model.d_model), model.dtype)
        if self.ranks > 1:
            sharding = self.local.activation_sharding if self.local else None
            self.transport = make_transport(pl.transport, topology.p2p, template, sharding)
        else:
            self.transport = InProcessHub(1).transport(0)  # one rank: its stages' messages stay in the loop
        # The report is the loop's (built below, before the watchdog is armed): its peers by world rank.
        self.watchdog = Watchdog(self.who, pl.watchdog_s, lambda: self.loop.report(), comm=topology.world,
                                 compile_deadline_s=pl.watchdog_compile_s)

        self.loop = EventLoop(self.stages, self.schedule.stage_to_rank, self.stage_index,
                              self.transport, loop_policy(self.schedule), join=weight_join(pl.weight_join), progress=self.watchdog.beat,
                              waiting=self.watchdog.note, peer_name=topology.name,  # row rank = place in the row
                              synced=synced_dispatch(pl.dispatch, jax.devices()[0].platform))
        self.chunk = cfg.optim.bucket_size * cfg.optim.allreduce_coarsening
        self.half_wire = cfg.optim.allreduce_dtype == "compute"  # Myelin IV-B: half-precision gradients travel
        # optim.allreduce_backend=xla: the column is a JAX mesh (every rank joined jax.distributed at start-up).
        self.xla_column = (XlaColumn.of(topology, self.local.mesh if self.local else None)
                           if cfg.optim.allreduce_backend == "xla" and self.replicas > 1 else None)
        self.microbatch_size = mb

    @property
    def stage(self) -> Stage:
        """The stage of a rank that runs one (benches and sweeps reuse its kernels)."""
        if len(self.stages) != 1:
            raise ValueError(f"{self.who} runs stages {sorted(self.stages)}, not one")
        return next(iter(self.stages.values()))

    def slice_params(self, full_params: dict) -> dict:
        """This rank's parts of the whole model's parameter dict (every stage it runs)."""
        return self._merge({s: st.slice_params(full_params) for s, st in self.stages.items()})

    def _split(self, params: dict) -> dict[int, dict]:
        """``{stage: its parts}`` of this rank's merged parameter dict, as the event loop takes them."""
        return {s: {k: params[k] for k in st.param_names} for s, st in self.stages.items()}

    @staticmethod
    def _merge(by_stage: dict[int, dict]) -> dict:
        """One dict of the stages' parts (their keys are disjoint: parts are named by model block)."""
        out: dict = {}
        for part in by_stage.values():
            out.update(part)
        return out

    def set_schedule(self, name: str, split_backward: bool, pipeline_limit: int = 0,
                     microbatches: int | None = None) -> None:
        """Switch to another schedule (benchmarks and parity sweeps reuse the compiled stage kernels).
        The microbatch size stays fixed (the transport's message shape); ``microbatches`` may change,
        and with it the global batch. Pure check first: a bad combination raises on every rank alike."""
        m = self.microbatches if microbatches is None else microbatches
        self.schedule = configured_schedule(self.cfg.pipeline, self.ranks, name, split_backward, pipeline_limit, m)
        self.loop.policy = loop_policy(self.schedule)  # the loop runs a schedule of its own policy's kind
        self.microbatches = m

    @property
    def tasks_timed(self) -> bool:
        """Whether the next step waits for every task (:meth:`time_tasks`, or ``pipeline.dispatch``)."""
        return self.loop.synced

    def time_tasks(self, on: bool = True) -> None:
        """From the next step on, every task waits for its kernel so the recorded events are kernel times
        (the step :meth:`write_trace` writes, benchmarks); off, kernels are dispatched asynchronously
        (Myelin Sec. IV-A; :mod:`~jaxhybrid.parallel.pipeline.event_loop`), whatever ``pipeline.dispatch`` chose."""
        self.loop.synced = on

    # -- GradEngine ----------------------------------------------------------------------------------
    def init_params(self, rng: jax.Array) -> dict:
        """This stage's slice of ``Model.init(rng)``: identical to the single-device initialisation
        (placed on the rank's tensor mesh in hybrid layouts)."""
        # Only this stage's parts, never the whole model; in hybrid layouts each device its own shards.
        shardings = self.local.param_shardings if self.local else None
        return self._merge({s: st.init_params(rng, shardings) for s, st in self.stages.items()})

    def _microbatches(self, batch: np.ndarray) -> np.ndarray:
        """This replica's microbatches ``[M, mb, seq+1]`` of the global batch (shape checked first)."""
        want = self.replicas * self.microbatches * self.microbatch_size
        if batch.shape[0] != want:
            raise ValueError(f"{self.who}: global batch of {batch.shape[0]} sequences; this engine expects "
                             f"replicas({self.replicas}) x microbatches({self.microbatches}) x microbatch size "
                             f"({self.microbatch_size}) = {want}")
        return split_batch(np.asarray(batch, np.int32), self.replica, self.replicas, self.microbatches)

    def _mean_over_batch(self, loss_sum) -> jnp.ndarray:
        """The global batch's mean loss on every rank from the last stages' microbatch-loss sums."""
        mine = float(loss_sum) if loss_sum is not None else 0.0
        return jnp.float32(self.topo.world.allreduce(mine) / (self.microbatches * self.replicas))

    def eval_loss(self, params: dict, batch: np.ndarray):
        """Validation loss: a forward-only pass of the pipeline over this replica's microbatches."""
        mbs = self._microbatches(batch)
        self.watchdog.arm("validation forward")
        try:
            return self._mean_over_batch(self.loop.evaluate(self._split(params), mbs))
        finally:
            self.watchdog.disarm()

    def loss_and_grads(self, params: dict, batch: np.ndarray, loss_scale: float):
        self.watchdog.arm("pipeline phase")
        try:
            early = self._early_sum()
            loss, grads = self._pipeline_phase(params, batch, loss_scale, early)
            if early is None and self.replicas > 1:  # the sum over the replicas after the phase
                self.watchdog.beat("data-parallel all-reduce")
                t0 = time.perf_counter()
                if self.xla_column is not None:
                    grads = self.xla_column.allreduce_tree(grads, self.chunk, half_wire=self.half_wire)
                else:
                    grads = allreduce_tree(grads, self.topo.column, self.chunk, half_wire=self.half_wire)
                if (record := self._recording()) is not None:  # the trace's all-reduce lane
                    jax.block_until_ready(grads)
                    record("all-reduce", "reduce", t0, time.perf_counter())
        finally:
            self.watchdog.disarm()
        return loss, grads

    @property
    def data_column(self) -> ReplicaColumn | None:
        """This stage's data replicas on the configured backend, under this rank's watchdog."""
        if self.replicas < 2:
            return None
        return ReplicaColumn(self.topo.column, self.xla_column, self.watchdog.watching, self._recording)

    def _recording(self):
        """Where a timed step (a trace) records a data-parallel reduction; None otherwise (no waiting)."""
        return self.loop.recorder.add if self.loop.synced else None

    def loss_and_local_grads(self, params: dict, batch: np.ndarray, loss_scale: float):
        self.watchdog.arm("pipeline phase")
        try:
            return self._pipeline_phase(params, batch, loss_scale)
        finally:
            self.watchdog.disarm()

    def _early_sum(self) -> EarlyColumnSum | None:
        """``optim.overlap_grad_reduce``: the column's sum started per stage during the phase, where it applies
        (the mpi backend, data replicas of one device each, a float32 wire); None elsewhere."""
        if not (self.cfg.optim.overlap_grad_reduce and self.replicas > 1 and self.xla_column is None
                and self.local is None and not self.half_wire):
            return None
        return EarlyColumnSum(self.topo.column, self.schedule.grads_final(self.stage_index), self.cfg.optim.bucket_size)

    def _pipeline_phase(self, params: dict, batch: np.ndarray, loss_scale: float,
                        early: EarlyColumnSum | None = None):
        """The schedule over this replica's microbatches: (global mean loss, this rank's gradients with
        tied embeddings summed), not reduced over replicas unless ``early`` sums them during the phase."""
        mbs = self._microbatches(batch)
        # Myelin IV-B: pre-divide by the microbatches of the whole global batch.
        cot = float(loss_scale) / (self.microbatches * self.replicas)
        self.loop.on_final = early.add if early is not None else None
        try:
            res = self.loop.run(self.schedule, self._split(params), mbs, cot)
        finally:
            self.loop.on_final = None
        by_stage = res.grads
        if early is not None:
            self.watchdog.beat("data-parallel all-reduce (started per stage)")
            by_stage = early.result(self._recording())  # the step's recorder: run() made a new one
        # The tied copies' sum over the row is linear: after the replicas' sums it gives the same total.
        grads = tied.sum_tied(self._merge(by_stage), self.schedule.stage_to_rank, self.stage_index,
                              self.cfg.model.tie_embeddings, self.topo.row)
        return self._mean_over_batch(res.loss_sum), grads

    @property
    def streams_reduced_chunks(self) -> bool:
        """Whether :meth:`loss_and_grad_chunks` applies: data replicas to reduce over and gradients on one
        device (a hybrid rank's sharded leaves reduce per device). A tied-embedding copy streams too: its
        gradient is summed before the chunks are cut, and the updater's norm leaves it out (:meth:`norm_view`)."""
        return self.replicas > 1 and self.local is None

    def loss_and_grad_chunks(self, params: dict, batch: np.ndarray, loss_scale: float, flatten):
        """Myelin V-C: the pipeline phase, then the data-parallel all-reduce left to the consumer, which
        gets ``(start, end, reduced)`` chunks of ``k x bsize`` elements of ``flatten(grads)``, each as soon
        as its reduction is done, reduced by a thread of their own while the consumer updates the chunks
        before (:func:`~jaxhybrid.parallel.data.allreduce.reduced_beside`; the step's trace records both).
        Returns ``(loss, chunks)``; the unreduced pytree is released once flattened (the footprint stays
        parameters + gradients + buckets + two reduced chunks)."""
        if not self.streams_reduced_chunks:
            raise ValueError(f"{self.who}: streamed all-reduce needs data replicas > 1 and one device per rank")
        self.watchdog.arm("pipeline phase")
        try:
            loss, grads = self._pipeline_phase(params, batch, loss_scale)
        finally:
            self.watchdog.disarm()
        flat = flatten(grads)
        release(grads)
        chunks = (self.xla_column.iter_reduced_chunks(flat, self.chunk, self.half_wire, ahead=False)
                  if self.xla_column else iter_reduced_chunks(flat, self.topo.column, self.chunk, self.half_wire,
                                                               ahead=False))
        watched = self._watched(chunks, "data-parallel all-reduce streamed into the optimizer")
        # Myelin V-C: the reductions in a thread of their own, beside the updates; both are lanes of the trace.
        return loss, reduced_beside(watched, self.loop.recorder.add)

    def _watched(self, chunks, what: str):
        """The chunk iterator under the watchdog: a dead peer mid-reduction ends the job, as in the phase."""
        self.watchdog.arm(what)
        try:
            yield from chunks
        finally:
            self.watchdog.disarm()

    def global_sum(self, x):
        """Sum over the stages of this replica (the model-parallel group)."""
        value = float(x)  # the local computation stays outside the deadline; only the wait is watched
        with self.watchdog.watching("sum over the stages (gradient norm)"):
            return jnp.float32(self.topo.row.allreduce(value))

    def global_max(self, x):
        from mpi4py import MPI

        value = float(x)
        with self.watchdog.watching("max over all ranks (overflow, stop or resume agreement)"):
            return jnp.float32(self.topo.world.allreduce(value, op=MPI.MAX))

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def norm_view(self, grads: dict) -> dict:
        """The gradients this rank contributes to the global norm (tied copies counted once)."""
        return tied.norm_view(grads)

    # -- trace and shutdown ----------------------------------------------------------------------------
    def gather_events(self) -> list | None:
        """The last step's events of every rank, on rank 0 (others get None), clocks aligned. The step must
        have been timed (:meth:`time_tasks`; every rank raises alike, before the barrier)."""
        self.loop.recorder.check_timed(self.who)
        with self.watchdog.watching("barrier before gathering the trace"):
            self.topo.world.Barrier()
        sync = time.perf_counter()
        events = [(e.name, e.kind, e.start - sync, e.end - sync, e.microbatches, e.stage)
                  for e in self.loop.recorder.events]
        with self.watchdog.watching("gathering the trace"):
            every = self.topo.world.gather(events, root=0)
        if self.rank != 0:
            return None

        return [[Event(r, *ev) for ev in evs] for r, evs in enumerate(every)]

    def write_trace(self, run_dir: str) -> dict | None:
        """Merged Chrome trace, Gantt PNG and measured bubble ratio of the last step (rank 0 writes)."""
        per_rank = self.gather_events()
        if per_rank is None:
            return None

        return write_measured(per_rank, run_dir, f"{self.schedule.name} measured")

    def close(self) -> None:
        self.watchdog.close()
        self.transport.close()


def make_transport(name: str, comm: Any, template: jax.ShapeDtypeStruct, sharding: Any = None):
    """``pipeline.transport``: ``mpi4jax`` (design card), ``mpi4py`` (host-staged Isend) or ``transfer``
    (pulled into device buffers by JAX's transfer server, through its pinned host memory and TCP); ``sharding``:
    the payloads' layout on this rank's tensor mesh (hybrid layouts), None for single-device stages."""
    kinds = {"mpi4jax": Mpi4jaxTransport, "mpi4py": Mpi4pyTransport, "transfer": TransferTransport}
    if name not in kinds:
        raise ValueError(f"pipeline.transport={name!r}; choose mpi4jax, mpi4py or transfer")
    return kinds[name](comm, template, sharding)
