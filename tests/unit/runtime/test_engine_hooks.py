"""GradEngine and Updater declare every hook the trainer calls; the layouts without a feature inherit its
default, so the trainer probes none of them."""
import jax.numpy as jnp
import optax
import pytest

from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.model import Model
from jaxhybrid.optim.offload_updater import OffloadUpdater
from jaxhybrid.optim.sharded_offload import ShardedOffloadUpdater
from jaxhybrid.optim.updater import DeviceUpdater, Updater
from jaxhybrid.runtime.engines.base import GradEngine, LocalEngine
from jaxhybrid.runtime.engines.pipeline import PipelineEngine
from jaxhybrid.runtime.engines.tensor import TensorEngine


def test_every_engine_is_a_grad_engine():
    assert all(issubclass(e, GradEngine) for e in (LocalEngine, PipelineEngine, TensorEngine))
    # The hooks a pipeline rank has of its own override the defaults.
    for hook in ("streams_reduced_chunks", "loss_and_grad_chunks", "norm_view", "tasks_timed", "time_tasks",
                 "write_trace", "close"):
        assert getattr(PipelineEngine, hook) is not getattr(GradEngine, hook), hook


def test_a_one_program_engine_inherits_the_defaults(tmp_path):
    eng = LocalEngine(Model(PRESETS["gpt-tiny"]))
    grads = {"w": jnp.ones(3)}
    assert eng.rank == 0 and not eng.streams_reduced_chunks and eng.tasks_timed
    assert eng.norm_view(grads) is grads  # every leaf counted once
    eng.time_tasks()
    assert eng.write_trace(str(tmp_path)) is None and not list(tmp_path.iterdir())
    eng.close()
    with pytest.raises(ValueError, match="LocalEngine does not stream reduced gradient chunks"):
        eng.loss_and_grad_chunks({}, None, 1.0, None)


def test_an_engine_missing_a_required_method_fails_when_built():
    class Partial(GradEngine):
        def init_params(self, rng):
            return {}

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_updaters_declare_streaming_and_restore_targets():
    assert all(issubclass(u, Updater) for u in (DeviceUpdater, OffloadUpdater, ShardedOffloadUpdater))
    assert OffloadUpdater.streams_chunks and not DeviceUpdater.streams_chunks
    assert not ShardedOffloadUpdater.streams_chunks
    assert ShardedOffloadUpdater.restore_like is not Updater.restore_like
    upd = DeviceUpdater(optax.adam(1e-3), grad_clip=1.0)
    state = upd.init({"w": jnp.ones(3)})

    def unread():
        raise AssertionError("the default restore target reads no checkpoint metadata")

    assert upd.restore_like(state, unread) is upd.state_dict(state)
    with pytest.raises(ValueError, match="DeviceUpdater takes whole gradients"):
        upd.apply_streamed({}, state, iter(()), 1.0, None, None)
    sq, nonfinite = upd.stats({"a": jnp.array([3.0]), "b": jnp.array([4.0])})
    assert float(sq) == 25.0 and float(nonfinite) == 0.0
    assert float(upd.stats({"a": jnp.array([jnp.inf])})[1]) == 1.0
