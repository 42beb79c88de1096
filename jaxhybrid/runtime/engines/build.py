"""The objects a config chooses: the engine for its layout and the updater for its optimizer. The trainer
builds them here once, so the step itself has no feature flags (a choice is made by building different
objects); and :func:`committed`, which places freshly built arrays where the step's jit expects them.
"""
from __future__ import annotations

import jax

from jaxhybrid.core.config.schema import Config
from jaxhybrid.model import Model
from jaxhybrid.model.attention import check_cudnn_device
from jaxhybrid.model.remat import whole_model_interval
from jaxhybrid.optim import build_transform, device_updater
from jaxhybrid.optim.offload_updater import OffloadUpdater
from jaxhybrid.optim.sharded_offload import ShardedOffloadUpdater
from jaxhybrid.optim.zero import ZeroUpdater
from jaxhybrid.parallel.pipeline.topology import Topology
from jaxhybrid.runtime.engines.base import LocalEngine
from jaxhybrid.runtime.engines.pipeline import PipelineEngine
from jaxhybrid.runtime.engines.tensor import TensorEngine


def build_engine(cfg: Config, model: Model):
    """Pick the engine for the configured layout: an MPI pipeline, one tensor mesh, or one device."""
    check_cudnn_device(cfg.model.attention, jax.devices()[0])  # before a rank joins its peers
    remat = cfg.train.remat
    if cfg.world_size > 1:
        return PipelineEngine(cfg, model, Topology.from_config(cfg))
    if cfg.on_mesh:
        return TensorEngine(cfg.model, cfg)
    return LocalEngine(model, cfg.pipeline.microbatches, remat=remat, interval=whole_model_interval(cfg))


def build_updater(cfg: Config, engine):
    """The optimizer for the configured layout: AdamW on the device, or Myelin's host-offloaded buckets (V-B),
    per device over the shards it owns when the parameters are sharded; with ``optim.shard_optimizer`` each
    data replica updates its shard of either (ZeRO-1)."""
    transform = build_transform(cfg.optim, cfg.train.steps)
    if cfg.optim.shard_optimizer:
        return ZeroUpdater(transform, cfg, engine.data_column)
    if not cfg.optim.offload:
        return device_updater(cfg)
    if cfg.tensor_size > 1 or cfg.on_mesh:  # each device offloads the shards it owns

        return ShardedOffloadUpdater(transform, cfg)

    return OffloadUpdater(transform, cfg)


def committed(tree, like=None):
    """Commit uncommitted device arrays. Freshly created arrays are uncommitted and the jit cache keys on
    that, so without this every jitted step would compile twice (steps 1 and 2). Leaves that are not yet
    placed go where ``like``'s leaves live: replicated over its mesh (tensor mode) or on its device."""
    ref = next((x for x in jax.tree.leaves(like if like is not None else tree) if isinstance(x, jax.Array)), None)
    if ref is None:
        return tree
    home = ref.sharding
    if isinstance(home, jax.sharding.NamedSharding):
        home = jax.sharding.NamedSharding(home.mesh, jax.sharding.PartitionSpec())

    def place(x):
        if not isinstance(x, jax.Array) or getattr(x, "committed", True):
            return x
        return jax.device_put(x, x.sharding if len(x.sharding.device_set) > 1 else home)

    return jax.tree.map(place, tree)
