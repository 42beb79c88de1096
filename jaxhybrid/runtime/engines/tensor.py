"""``TensorEngine``: one training step of the whole model over the 4D (data, depth, row, col) mesh.

A :class:`jaxhybrid.runtime.engines.base.GradEngine` for ``parallel.pipeline == 1`` and a tensor grid larger than one.
One process owns every device of the mesh (fake CPU devices in tests; on a cluster the mesh spans the
processes of ``jax.distributed``, see :mod:`jaxhybrid.parallel.tensor`). Parameters and gradients are the same
flat pytree as ``Model.init``, as global arrays sharded by :func:`jaxhybrid.parallel.tensor.sharding.param_spec`,
so the trainer's optimizer, clipping and checkpoints work on them unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.model import Model, compiled_init, remat_policy
from jaxhybrid.model.remat import whole_model_interval
from jaxhybrid.parallel.tensor.mesh import DATA, make_mesh, reduce_data_once
from jaxhybrid.parallel.tensor.ops import TensorOps
from jaxhybrid.parallel.tensor.sharding import batch_sharding, check_layout, param_shardings
from jaxhybrid.runtime.engines.base import GradEngine, accumulated_step, mean_loss


def order_microbatches(batch: np.ndarray, replicas: int, microbatches: int) -> np.ndarray:
    """``[B, S+1] -> [M, B/M, S+1]`` such that microbatch ``m`` holds, for every replica ``j``, the rows
    :func:`jaxhybrid.runtime.engines.base.split_batch` gives replica ``j`` as its microbatch ``m`` (tokens per step and
    their assignment do not depend on the layout)."""
    b = batch.shape[0]
    per = b // (replicas * microbatches)
    x = batch.reshape(replicas, microbatches, per, *batch.shape[1:])
    return np.ascontiguousarray(np.swapaxes(x, 0, 1).reshape(microbatches, replicas * per, *batch.shape[1:]))


class TensorEngine(GradEngine):
    """AxoNN 4D step: data x (depth, row, col) tensor parallelism in one jitted program.

    Args:
      model_cfg: the model.
      cfg: the run config (parallel.data/tensor_*, pipeline.microbatches, tensor.optimizations,
        train.global_batch, train.remat, precision.compute_dtype).
      devices: devices for the mesh (default: all).
      compiler_options: XLA options for the step's compile (tests pass a low backend optimization
        level to halve compile time; numerics of the collectives and matmuls do not depend on it).
    """

    def __init__(self, model_cfg: ModelConfig, cfg, devices=None, compiler_options: dict | None = None):
        devs = list(jax.devices() if devices is None else devices)
        self.dims = cfg.layout
        self.dims.check_devices(len(devs))
        letters = cfg.tensor.optimizations
        self.microbatches = cfg.pipeline.microbatches
        check_layout(model_cfg, self.dims, cfg.train.global_batch // self.microbatches, letters)
        self.mesh = make_mesh(self.dims, devs)
        self.ops = TensorOps.build(self.mesh, model_cfg.n_heads, model_cfg.kv_heads, letters)
        self.model = Model(model_cfg, self.ops, cfg.precision.compute_dtype)
        self.reference = Model(model_cfg, compute_dtype=cfg.precision.compute_dtype)
        self.shardings = param_shardings(self.reference.abstract_params(), self.mesh, self.ops.letters)
        self._batch_sharding = batch_sharding(self.mesh)
        # Optimization E: the gathered weights are saved across recomputation (AxoNN Sec. IV-E).
        remat = remat_policy(cfg.train.remat, self.ops.saved_names)
        interval = whole_model_interval(cfg)  # Myelin V-A's ac, as the single-device engine segments
        model = self.model
        # Per layer, eq. 8 runs in its backward and may overlap the layers below (AxoNN); with enough
        # microbatches per-replica gradients accumulate over the scan instead and are reduced once after it
        # (accumulated_step's replicas), where that moves fewer bytes.
        once = reduce_data_once(self.dims.data, self.microbatches, jnp.dtype(cfg.precision.compute_dtype).itemsize)
        replicas = self.dims.data if once else 1
        train = Model(model_cfg, self.ops.per_replica(), cfg.precision.compute_dtype) if replicas > 1 else model
        step = accumulated_step(lambda p, mb: train.loss(p, mb[:, :-1], mb[:, 1:], remat=remat, interval=interval),
                                replicas, DATA)
        rep = NamedSharding(self.mesh, P())
        self._step = jax.jit(step, in_shardings=(self.shardings, self._batch_sharding, rep),
                             out_shardings=(rep, self.shardings), compiler_options=compiler_options)
        self._eval = jax.jit(lambda params, mbs: mean_loss(model, params, mbs), out_shardings=rep,
                             in_shardings=(self.shardings, self._batch_sharding), compiler_options=compiler_options)

    def init_params(self, rng: jax.Array):
        """``Model.init`` values computed in place, each device only its shards (no device ever holds the
        whole model), bit-identical to LocalEngine's init (test_tensor_engine)."""
        return compiled_init(self.reference, rng, None, self.shardings)

    def device_batch(self, batch: np.ndarray) -> jax.Array:
        mbs = order_microbatches(np.asarray(batch, np.int32), self.dims.data, self.microbatches)
        return jax.device_put(mbs, self._batch_sharding)

    def loss_and_grads(self, params, batch: np.ndarray, loss_scale: float):
        return self._step(params, self.device_batch(batch), jnp.float32(loss_scale))

    def eval_loss(self, params, batch: np.ndarray) -> jax.Array:
        """Validation loss: the step's forward through the same tensor ops, no gradients."""
        return self._eval(params, self.device_batch(batch))

    def lower(self, params, batch: np.ndarray, loss_scale: float = 1.0):
        """The lowered step (for HLO inspection and the benchmark)."""
        return self._step.lower(params, self.device_batch(batch), jnp.float32(loss_scale))

    def global_sum(self, x):
        return x  # one global program: values are already global

    def global_max(self, x):
        # The global program's values are the same in every process; a host value (a stop request,
        # jaxhybrid/runtime/stop.py) is not, and across processes (--distributed) they agree on its max: one that
        # stopped alone would leave the others waiting in the next step's collectives (and its save).
        if isinstance(x, jax.Array) or jax.process_count() == 1:
            return x
        from jax.experimental import multihost_utils

        return float(np.max(multihost_utils.process_allgather(np.float32(x))))

    @property
    def is_writer(self) -> bool:
        return jax.process_index() == 0
