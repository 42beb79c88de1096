"""The seam between the trainer and every parallel layout: a gradient engine.

The trainer (``jaxhybrid.runtime.trainer``) owns the optimizer, loss scaling, metrics and checkpoints; an engine
owns how one global batch becomes this process's loss and gradients. ``LocalEngine`` is the
single-device reference every other engine (pipeline, tensor, hybrid) is compared with.
"""
from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.model import Model, compiled_init, remat_policy

Params = dict[str, Any]


class GradEngine(abc.ABC):
    """How one process computes its share of a training step: every hook the trainer calls.

    ``batch`` is the whole global batch, ``int32 [global_batch, seq_len + 1]`` (inputs are
    ``batch[:, :-1]``, targets ``batch[:, 1:]``), identical on every rank; an engine slices out its
    data replica and microbatches. ``loss_and_grads`` returns the mean loss over the global batch (the
    same value on every rank) and the gradients of ``loss * loss_scale`` with respect to this process's
    float32 parameters, already reduced over data replicas.

    A base class, not a Protocol: the hooks only some layouts need (streamed all-reduce, the norm's view of
    tied copies, the trace, shutdown) have one no-op default here that every engine inherits, so the
    trainer calls each hook unconditionally; the abstract methods fail at construction, not mid-run.
    """

    rank: int = 0  # this process's MPI rank (checkpoint folder, messages); one-process layouts: 0

    @abc.abstractmethod
    def init_params(self, rng: jax.Array) -> Params: ...

    @abc.abstractmethod
    def loss_and_grads(self, params: Params, batch: np.ndarray, loss_scale: float) -> tuple[jax.Array, Params]: ...

    @abc.abstractmethod
    def eval_loss(self, params: Params, batch: np.ndarray) -> jax.Array:
        """Mean loss over a global batch laid out as for ``loss_and_grads``, forward only (validation);
        the same value on every rank."""

    @abc.abstractmethod
    def global_sum(self, x: jax.Array) -> jax.Array:
        """Sum a scalar over the model-parallel group (stages), e.g. for the global gradient norm."""

    @abc.abstractmethod
    def global_max(self, x: jax.Array) -> jax.Array:
        """Max of a scalar over all ranks (overflow agreement)."""

    @property
    @abc.abstractmethod
    def is_writer(self) -> bool:
        """True on the one process that writes metrics and run-level files."""

    # -- hooks with a default: what a layout without the feature does ------------------------------------
    @property
    def streams_reduced_chunks(self) -> bool:
        """Whether :meth:`loss_and_grad_chunks` applies (Myelin V-C: data replicas reduced chunk by chunk
        into the offloaded update). Default: no; the gradients come whole from :meth:`loss_and_grads`."""
        return False

    def loss_and_grad_chunks(self, params: Params, batch: np.ndarray, loss_scale: float, flatten):
        """``(loss, chunks)`` of the reduced flat gradients; only where :attr:`streams_reduced_chunks`."""
        raise ValueError(f"{type(self).__name__} does not stream reduced gradient chunks "
                         f"(streams_reduced_chunks is false): call loss_and_grads")

    @property
    def data_column(self) -> Any:
        """This process's data replicas as a :class:`~jaxhybrid.parallel.data.column.ReplicaColumn` for an
        optimizer sharded over them (``optim.shard_optimizer``). Default: None, no replicas that are ranks."""
        return None

    def loss_and_local_grads(self, params: Params, batch: np.ndarray, loss_scale: float):
        """``(loss, grads)`` as :meth:`loss_and_grads` but before the sum over data replicas, which the sharded
        optimizer does as a reduce-scatter; only where :attr:`data_column` is not None."""
        raise ValueError(f"{type(self).__name__} has no data replicas to shard an optimizer over (data_column is None)")

    def norm_view(self, grads: Params) -> Params:
        """The gradients this process contributes to the global norm. Default: all of them (no leaf is
        held twice)."""
        return grads

    @property
    def tasks_timed(self) -> bool:
        """Whether a step's recorded task times are kernel times. Default: true, one program per step whose
        time the trainer measures itself, and nothing to record apart."""
        return True

    def time_tasks(self, on: bool = True) -> None:
        """From the next step on, wait for each task's kernel so a trace records kernel times. Default:
        nothing to time apart."""

    def write_trace(self, run_dir: str) -> dict | None:
        """Write the last step's trace into ``run_dir`` (collective where ranks gather events); returns its
        summary on the writer. Default: no per-task events, no trace (``metrics.trace`` is noted as unused)."""
        return None

    def close(self) -> None:
        """Release communicators, transports and watchdogs once every rank has finished. Default: nothing held."""


def split_batch(batch: np.ndarray, replica: int, replicas: int, microbatches: int) -> np.ndarray:
    """This replica's microbatches: ``[M, mb, seq+1]``. Tokens per step do not depend on the layout:
    replica ``j`` takes rows ``j*B/D .. (j+1)*B/D`` and cuts them into ``M`` equal microbatches."""
    b = batch.shape[0]
    per = b // replicas
    mine = batch[replica * per:(replica + 1) * per]
    return mine.reshape(microbatches, per // microbatches, *batch.shape[1:])


def mean_loss(model: Model, params: Params, mbs: jax.Array) -> jax.Array:
    """Forward-only mean loss over microbatches ``[M, mb, seq+1]`` (equal sizes, so the mean of their
    means is the batch mean); one microbatch at a time, as the training step holds them."""
    losses = jax.lax.map(lambda mb: model.loss(params, mb[:, :-1], mb[:, 1:]), mbs)
    return jnp.mean(losses)


def accumulated_step(loss_fn, replicas: int = 1, axis: str | None = None):
    """The jittable training step of the one-program engines (local and tensor): ``step(params, mbs,
    scale) -> (mean loss, mean gradients of loss * scale)`` over microbatches ``[M, mb, seq+1]``,
    accumulated in a ``lax.scan`` (one microbatch's activations live at a time); ``loss_fn(params, mb)``
    is the model's mean loss on one microbatch. With ``M == 1`` it is ``jax.value_and_grad`` alone.

    ``replicas > 1`` (the tensor engine's data axis, ``axis``): each microbatch's rows are cut into that
    many equal blocks, one per data replica, and ``loss_fn`` runs under ``jax.vmap`` over them
    (``spmd_axis_name=axis``, so replica ``j``'s block and gradients live on replica ``j``). The
    gradients come out stacked per replica, not summed, the scan accumulates each replica's own, and one
    mean over replicas after it is AxoNN's data all-reduce (eq. 8) once per step instead of once per
    microbatch. ``loss_fn`` must then be built for one replica's rows (``TensorOps.per_replica``).
    """
    def value_and_grad(params, mb, scale):
        return jax.value_and_grad(lambda p: loss_fn(p, mb) * scale)(params)

    if replicas > 1:
        value_and_grad = jax.vmap(value_and_grad, in_axes=(None, 0, None), spmd_axis_name=axis)

    def step(params, mbs, scale):
        m = mbs.shape[0]
        if replicas > 1:  # rows are ordered replica-major (data before depth in the batch sharding)
            mbs = mbs.reshape(m, replicas, mbs.shape[1] // replicas, *mbs.shape[2:])

        def one(carry, mb):
            return jax.tree.map(jnp.add, carry, value_and_grad(params, mb, scale)), None

        if m == 1:
            total, grads = value_and_grad(params, mbs[0], scale)
        else:
            lead = (replicas,) if replicas > 1 else ()  # one loss and gradient per replica when vmapped
            init = (jnp.zeros(lead, jnp.float32), jax.tree.map(lambda p: jnp.zeros(lead + p.shape, p.dtype), params))
            (total, grads), _ = jax.lax.scan(one, init, mbs)
        if replicas > 1:
            total, grads = jax.tree.map(lambda x: x.mean(0), (total, grads))
        return total / (m * scale), jax.tree.map(lambda x: x / m, grads)

    return step


class LocalEngine(GradEngine):
    """Single device, whole model; microbatches accumulate in one jitted step (gradient accumulation).

    With ``microbatches == 1`` this is exactly ``jax.value_and_grad`` of the model loss.
    """

    def __init__(self, model: Model, microbatches: int = 1, remat: str = "none", interval: int = 1):
        self.model = model
        self.microbatches = microbatches
        policy = remat_policy(remat)

        def loss_fn(params, mb):
            return model.loss(params, mb[:, :-1], mb[:, 1:], remat=policy, interval=interval)

        self._step = jax.jit(accumulated_step(loss_fn))
        self._eval = jax.jit(lambda params, mbs: mean_loss(model, params, mbs))

    def init_params(self, rng: jax.Array) -> Params:
        # Compiled as every engine's init (a sharded compiled init gives the same bits, an eager one differs
        # by ~1e-8), so parallel layouts start from this run's exact parameters.
        return compiled_init(self.model, rng)

    def loss_and_grads(self, params: Params, batch: np.ndarray, loss_scale: float):
        mbs = split_batch(np.asarray(batch, np.int32), 0, 1, self.microbatches)
        return self._step(params, jnp.asarray(mbs), jnp.float32(loss_scale))

    def eval_loss(self, params: Params, batch: np.ndarray) -> jax.Array:
        return self._eval(params, jnp.asarray(split_batch(np.asarray(batch, np.int32), 0, 1, self.microbatches)))

    def global_sum(self, x):
        return x

    def global_max(self, x):
        return x

    @property
    def is_writer(self) -> bool:
        return True
