"""Host offload with sharded parameters (tensor meshes): each device streams the shards it owns.

Fed the same gradients, the per-device optimizers must reproduce the single-device offloaded optimizer
exactly (elementwise AdamW, one global clip factor); the checkpoint format is the single-device one in
both directions; every element is offloaded by exactly one device. The end-to-end tensor-mode run
(TensorEngine gradients) is compared with the single-device run at the fp32 parity tolerance.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.model import Model, compiled_init
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim import build_transform
from jaxhybrid.optim.offload_updater import OffloadUpdater
from jaxhybrid.optim.sharded_offload import ShardedOffloadUpdater, is_sharded
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.base import LocalEngine
from jaxhybrid.runtime.engines.tensor import TensorEngine

FAST = {"xla_backend_optimization_level": 0}
STEPS = 3


def _cfg(**sets):
    base = {"model.name": "gpt-tiny", "model.n_layers": 1, "train.global_batch": 8, "data.seq_len": 8,
            "optim.offload": "true", "optim.bucket_size": 3000, "optim.grad_clip": 0.5, "optim.warmup_steps": 0,
            "optim.eps": 1e-3, "parallel.data": 2, "parallel.tensor_row": 2, "parallel.tensor_col": 2}
    base.update(sets)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def _batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (8, 9)).astype(np.int32) for _ in range(STEPS)]


def _run(engine, updater, cfg):
    # The engine's jitted init (TensorEngine's in place on the mesh): the same bits as a jitted Model.init,
    # which the exact comparison below starts from (an eager, op-by-op init is slower and differs by ~1e-7).
    params = engine.init_params(jax.random.key(0))
    state = updater.init(params)
    params = updater.compute_params(params)
    seen = []  # (gradients, squared global norm, overflow flag) of every step, on the host
    for b in _batches():
        _, grads = engine.loss_and_grads(params, b, 1.0)
        stats = updater.stats(grads)
        seen.append((jax.device_get(grads), *(np.float32(v) for v in stats)))
        params, state, _ = updater.apply(params, state, grads, 1.0, *stats)
    return params, state, seen


@pytest.fixture(scope="module")
def tensor_run():
    cfg = _cfg()
    engine = TensorEngine(cfg.model, cfg, compiler_options=FAST)
    upd = ShardedOffloadUpdater(build_transform(cfg.optim, cfg.train.steps), cfg)
    params, state, grads = _run(engine, upd, cfg)
    return cfg, upd, params, state, grads


def test_each_element_is_offloaded_by_one_device(tensor_run):
    cfg, upd, params, _, _ = tensor_run
    assert is_sharded(params) and len(upd.opts) > 1
    owned = sum(opt.layout.n for opt in upd.opts.values())
    assert owned == upd.gspec.n, f"devices offload {owned} elements; the model has {upd.gspec.n}"
    sizes = [opt.layout.n for opt in upd.opts.values()]
    # Balanced over all 8 devices (the data axis too), within the largest shard of any leaf.
    largest = max(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(params))
    assert len(sizes) == 8 and max(sizes) - min(sizes) <= largest, f"host state not spread evenly: {sizes}"
    for x in jax.tree.leaves(params):  # the compute copies keep the parameters' shardings
        assert len(x.sharding.device_set) == 8


def test_same_gradients_give_the_single_device_offload_exactly(tensor_run):
    """Same gradients and the same clip statistics: the update is elementwise, so bit for bit. The
    statistics themselves are reductions over sharded leaves, whose summation order follows the mesh
    (and the CPU's vector width), so they agree with the single-device ones to fp32_parity, not bits."""
    cfg, upd, params, state, seen = tensor_run
    ref = OffloadUpdater(build_transform(cfg.optim, cfg.train.steps), cfg)
    p = compiled_init(Model(cfg.model), jax.random.key(0))
    s = ref.init(p)
    p = ref.compute_params(p)
    for step, (g, sq, nonfinite) in enumerate(seen):
        ref_sq, ref_nonfinite = ref.stats(g)
        assert_tree_close(sq, np.float32(ref_sq), "fp32_parity", f"step {step} squared gradient norm")
        assert nonfinite == ref_nonfinite == 0, (step, nonfinite, ref_nonfinite)
        p, s, _ = ref.apply(p, s, g, 1.0, jnp.float32(sq), jnp.float32(nonfinite))
    assert_tree_close(jax.device_get(params), jax.device_get(p), "exact", "params ")
    assert_tree_close(upd.state_dict(state), ref.state_dict(s), "exact", "state_dict ")
    # Checkpoints cross layouts: the single-device state loads into the sharded updater and back.
    again = upd.load_state_dict(state, ref.state_dict(s))
    assert_tree_close(upd.state_dict(again), ref.state_dict(s), "exact", "loaded state_dict ")


def test_skipped_step_keeps_the_parameters_on_every_holder(tensor_run):
    """An overflowed step returns the state's parameters (each device's vector of its own length, padded
    for the one-program assembly) with the params' shardings, every replica equal to its owner's."""
    _, upd, params, state, _ = tensor_run
    assert upd._gather is not None, "one process on one mesh: the updated leaves come from one program"
    before = jax.device_get(params)
    p = jax.tree.map(lambda x: x.copy(), params)
    g = jax.tree.map(lambda x: x * 0, params)
    out, again, _ = upd.apply(p, state, g, 1.0, np.float32(0), np.float32(1))
    assert again.per_device.keys() == state.per_device.keys()
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
        assert x.sharding == y.sharding
    assert_tree_close(jax.device_get(out), before, "exact", "skipped step params ")


def test_tensor_mode_offload_matches_single_device_run(tensor_run):
    cfg, _, params, state, _ = tensor_run
    one = _cfg(**{"parallel.data": 1, "parallel.tensor_row": 1, "parallel.tensor_col": 1})
    ref = OffloadUpdater(build_transform(one.optim, one.train.steps), one)
    p, s, _ = _run(LocalEngine(Model(one.model)), ref, one)
    assert_tree_close(jax.device_get(params), jax.device_get(p), "fp32_parity", "params ")
    upd = tensor_run[1]
    assert_tree_close(upd.master_params(state), ref.opt.master_params(s), "fp32_parity", "fp32 masters ")


def test_memory_report_counts_one_devices_shards(tensor_run):
    """The run's memory report is per device: a (data 2, row 2, col 2) mesh holds about a quarter of
    the parameters on each device (replicated norms and biases on top); one device holds them all."""
    from jaxhybrid.optim.memory_report import params_per_device

    _, upd, params, _, _ = tensor_run
    total = upd.gspec.n
    assert total / 4 <= params_per_device(params) < total / 2, (params_per_device(params), total)
    host = jax.device_get(params)
    assert params_per_device(host) == total
    assert params_per_device(jax.device_put(host, jax.devices()[0])) == total


def test_bench_offload_tensor_prints_side_by_side_json(capsys):
    """``jaxhybrid bench offload --tensor``: both updaters on one mesh, one JSON object; the per-device
    offload holds fewer device bytes than the on-device update, and the host state is split evenly."""
    from jaxhybrid.cli.main import main

    rc = main(["bench", "offload", "--tensor", "2,1,2,2", "--model", "gpt-tiny", "--set", "model.n_layers=1",
               "--set", "train.global_batch=8", "--set", "data.seq_len=16", "--steps", "1", "--rounds", "1",
               "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["mesh"] == {"data": 2, "depth": 1, "row": 2, "col": 2}
    assert 0 < out["device_bytes_offload"] < out["device_bytes_baseline"]
    assert out["host_elements_per_device"]["max"] <= 1.5 * out["host_elements_per_device"]["min"]
    assert out["step_time_ratio"] > 0
