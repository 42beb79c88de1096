"""The seam between the trainer and every parallel layout: a gradient engine.

The trainer (``jaxhybrid.runtime.trainer``) owns the optimizer, loss scaling, metrics and checkpoints; an engine
owns how one global batch becomes this process's loss and gradients. ``LocalEngine`` is the
single-device reference every other engine (pipeline, tensor, hybrid) is compared with.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.model import Model, remat_policy

Params = dict[str, Any]


class GradEngine(Protocol):
    """How one process computes its share of a training step.

    ``batch`` is the whole global batch, ``int32 [global_batch, seq_len + 1]`` (inputs are
    ``batch[:, :-1]``, targets ``batch[:, 1:]``), identical on every rank; an engine slices out its
    data replica and microbatches. ``loss_and_grads`` returns the mean loss over the global batch (the
    same value on every rank) and the gradients of ``loss * loss_scale`` with respect to this process's
    float32 parameters, already reduced over data replicas.
    """

    def init_params(self, rng: jax.Array) -> Params: ...

    def loss_and_grads(self, params: Params, batch: np.ndarray, loss_scale: float) -> tuple[jax.Array, Params]: ...

    def eval_loss(self, params: Params, batch: np.ndarray) -> jax.Array:
        """Mean loss over a global batch laid out as for ``loss_and_grads``, forward only (validation);
        the same value on every rank."""
        ...

    def global_sum(self, x: jax.Array) -> jax.Array:
        """Sum a scalar over the model-parallel group (stages), e.g. for the global gradient norm."""
        ...

    def global_max(self, x: jax.Array) -> jax.Array:
        """Max of a scalar over all ranks (overflow agreement)."""
        ...

    @property
    def is_writer(self) -> bool:
        """True on the one process that writes metrics and run-level files."""
        ...


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


class LocalEngine:
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
        # Jitted as every engine's init (a sharded jitted init gives the same bits, an eager one differs
        # by ~1e-8), so parallel layouts start from this run's exact parameters.
        self._init = jax.jit(model.init)

    def init_params(self, rng: jax.Array) -> Params:
        return self._init(rng)

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
