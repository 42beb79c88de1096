"""TensorEngine and the 3D layer: bad input, memory per device, exact init, the 2BP split, switches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.model import Model
from jaxhybrid.model.transformer import _INIT_PROGRAMS
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim import DeviceUpdater, build_transform
from jaxhybrid.parallel.tensor.linear import NORMAL, TRANSPOSED, Linear3D, Switches
from jaxhybrid.parallel.tensor.mesh import make_mesh
from jaxhybrid.parallel.tensor.sharding import check_layout, is_fully_sharded
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.base import LocalEngine, split_batch
from jaxhybrid.runtime.engines.tensor import TensorEngine, order_microbatches

FAST = {"xla_backend_optimization_level": 0}


def _cfg(shape, *extra, check=True):
    d, dep, r, c = shape
    return load_config(None, ["model.name=gpt-tiny", "model.n_layers=1", "train.global_batch=8",
                              "data.seq_len=8", f"parallel.data={d}", f"parallel.tensor_depth={dep}",
                              f"parallel.tensor_row={r}", f"parallel.tensor_col={c}", *extra], check=check)


def test_mesh_product_must_equal_device_count():
    with pytest.raises(ValueError, match=r"data\(1\) x depth\(2\) x row\(2\) x col\(1\) = 4 != 8 devices"):
        make_mesh(ParallelDims.from_mesh_shape((1, 2, 2, 1)))
    cfg = _cfg((1, 2, 2, 1))
    with pytest.raises(ValueError, match="= 4 != 8 devices.*xla_force_host_platform_device_count=4"):
        TensorEngine(cfg.model, cfg)


def test_indivisible_sizes_name_values_and_rule():
    cfg = _cfg((1, 1, 1, 8), "model.d_model=36", "model.n_heads=4", check=False)
    with pytest.raises(ValueError, match=r"layer attn.qkv: output features n=108 not divisible by col\(8\).*"
                                         r"Rule: a dim split over mesh axes must be a multiple"):
        TensorEngine(cfg.model, cfg)
    with pytest.raises(ValueError, match=r"batch of 4 sequences per microbatch is not divisible by data\(2\) x "
                                         r"depth\(4\) = 8"):
        check_layout(cfg.model.__class__(), ParallelDims.from_mesh_shape((2, 4, 1, 1)), 4)
    with pytest.raises(ValueError, match=r"layer mlp.down: input features k=256 not divisible by col\(1\) x "
                                         r"depth\(512\)"):
        check_layout(cfg.model.__class__(), ParallelDims.from_mesh_shape((1, 512, 1, 1)), 512)
    with pytest.raises(ValueError, match="unknown letters"):
        TensorEngine(cfg.model, _cfg((1, 2, 2, 2), "tensor.optimizations=ABX"))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (2, 1, 1, 4), (1, 8, 1, 1)])
def test_per_device_bytes_of_weights_and_adam_state(shape):
    cfg = _cfg(shape)
    eng = TensorEngine(cfg.model, cfg)
    params = eng.init_params(jax.random.key(0))
    state = DeviceUpdater(build_transform(cfg.optim, 10), 1.0).init(params)
    g_tensor = eng.dims.tensor_size
    mu, nu = state[0].mu, state[0].nu
    for tree in (params, mu, nu):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        sharded = [(p, x) for p, x in flat if is_fully_sharded(tuple(getattr(k, "key", "") for k in p))]
        assert len(sharded) == 6  # wte, qkv, attn_out, mlp_up, mlp_down and the untied head kernel
        for path, x in sharded:
            per_device = {s.data.nbytes for s in x.addressable_shards}
            assert per_device == {x.nbytes // g_tensor}, jax.tree_util.keystr(path)


def test_init_is_the_single_device_init_bit_for_bit_computed_in_place():
    """Each device computes only its shards (never the whole model), and the values are the
    single-device engine's bit for bit."""
    cfg = _cfg((1, 2, 2, 2))
    eng = TensorEngine(cfg.model, cfg)
    got = eng.init_params(jax.random.key(3))
    assert_tree_close(got, LocalEngine(Model(cfg.model)).init_params(jax.random.key(3)), "exact", "init")
    assert got["block_000"]["attn_out"]["kernel"].sharding.spec == TRANSPOSED.w_spec  # optimization A
    assert got["block_000"]["attn_out"]["kernel"].sharding == eng.shardings["block_000"]["attn_out"]["kernel"]
    # Computed in place: per device, the block init program's outputs and scratch stay well below a block.
    block = next(f for (m, kind, _, placed), f in _INIT_PROGRAMS.items()
                 if m == eng.reference and kind == "block" and placed and placed[0].mesh == eng.mesh)
    mem = block.lower(jax.random.key(3), jnp.int32(1)).compile().memory_analysis()
    whole = sum(x.nbytes for x in jax.tree.leaves(got["block_000"]))
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < whole / 2, (mem, whole)


def test_microbatch_order_matches_split_batch():
    batch = np.arange(24 * 3).reshape(24, 3)
    got = order_microbatches(batch, replicas=2, microbatches=3)
    for m in range(3):
        for j in range(2):
            np.testing.assert_array_equal(got[m, j * 4:(j + 1) * 4], split_batch(batch, j, 2, 3)[m])


@pytest.mark.slow
def test_microbatches_and_data_parallel_accumulate_like_single_device():
    cfg = _cfg((2, 2, 1, 2), "pipeline.microbatches=2")
    batch = np.random.RandomState(1).randint(0, 256, (8, 9)).astype(np.int32)
    eng = TensorEngine(cfg.model, cfg, compiler_options=FAST)
    ref = LocalEngine(Model(cfg.model), microbatches=2)
    p = ref.init_params(jax.random.key(0))
    loss, grads = eng.loss_and_grads(jax.device_put(p, eng.shardings), batch, 4.0)
    loss_r, grads_r = ref.loss_and_grads(p, batch, 4.0)
    assert_tree_close(loss, loss_r, "fp32_parity", "loss")
    assert_tree_close(grads, grads_r, "fp32_parity", "grads")


@pytest.mark.parametrize("lay", [NORMAL, TRANSPOSED], ids=["normal", "transposed"])
def test_split_backward_islands_equal_autodiff(lay):
    """2BP: input_grad and weight_grad run as separate islands give the single-device vjp."""
    mesh = make_mesh(ParallelDims.from_mesh_shape((2, 2, 1, 2)))
    layer = Linear3D(mesh, lay, Switches())
    k = jax.random.split(jax.random.key(0), 4)
    x, w = jax.random.normal(k[0], (8, 4, 16)), jax.random.normal(k[1], (16, 8))
    b, dy = jax.random.normal(k[2], (8,)), jax.random.normal(k[3], (8, 4, 8))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    xs, ws, bs = put(x, lay.x_spec()), put(w, lay.w_spec), put(b, lay.b_spec)
    y, wg = jax.jit(layer.forward)(xs, ws, bs)
    dx = jax.jit(layer.input_grad)(put(dy, lay.y_spec()), wg)
    dw, db = jax.jit(layer.weight_grad, static_argnums=2)(xs, put(dy, lay.y_spec()), True)
    y_r, vjp = jax.vjp(lambda x, w, b: x @ w + b, x, w, b)
    assert_tree_close((y, dx, dw, db), (y_r, *vjp(dy)), "fp32_kernel", "split backward")


def test_switches_change_the_lowered_program():
    """B, C, D off pin the order with optimization barriers; E keeps the gathered W across remat."""
    def lowered(letters):
        cfg = _cfg((1, 2, 2, 2), f"tensor.optimizations={letters}", "train.remat=full")
        eng = TensorEngine(cfg.model, cfg)
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              Model(cfg.model).abstract_params(), eng.shardings)
        return eng._step.lower(params, jax.ShapeDtypeStruct((1, 8, 9), jnp.int32, sharding=eng._batch_sharding),
                               jnp.float32(1.0)).as_text()

    on, no_e, off = lowered("ABCDE"), lowered("ABCD"), lowered("A")
    assert on.count("optimization_barrier") < off.count("optimization_barrier")
    assert on.count("all_gather") < no_e.count("all_gather")  # E: no re-gather in the recomputation


def _outer_remats(jaxpr) -> int:
    """Checkpointed regions not nested in another one (the block segments, plus the norms and attention
    cores outside any segment: a count that only the segmenting changes)."""
    n = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "remat2":
            n += 1
            continue
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(getattr(sub, "jaxpr", sub), "jaxpr", getattr(sub, "jaxpr", sub))
                if hasattr(sub, "eqns"):
                    n += _outer_remats(sub)
    return n


def test_full_remat_segments_follow_the_checkpoint_interval():
    """train.remat=full recomputes segments of train.checkpoint_interval blocks, and without one Myelin's
    optimal ac (Sec. V-A: 2 of gpt-tiny's 4 blocks), as the single-device engine does; the tensor engine
    used to wrap every block alone whatever the setting."""
    def segments_plus_rest(*extra):
        cfg = _cfg((2, 1, 2, 2), "model.n_layers=4", "train.remat=full", *extra)
        eng = TensorEngine(cfg.model, cfg)
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              Model(cfg.model).abstract_params(), eng.shardings)
        batch = jax.ShapeDtypeStruct((1, 8, 9), jnp.int32)
        return _outer_remats(jax.make_jaxpr(eng._step)(params, batch, jnp.float32(1.0)).jaxpr)

    one, optimal, every = (segments_plus_rest(*e) for e in (["train.checkpoint_interval=4"], [],
                                                            ["train.checkpoint_interval=1"]))
    assert (optimal - one, every - one) == (1, 3), (one, optimal, every)


@pytest.mark.parametrize("kind,row_psums", [("layer_norm", (2, 3)), ("rms_norm", (1, 1))])
def test_tensor_norms_match_reference_and_reduce_nothing_again(kind, row_psums):
    """TensorOps' norms (features split over row) equal the single-device ones, value and gradients, and
    their backward psums over row only the statistics' cotangents (RMSNorm: the mean square's; LayerNorm:
    the mean's, the variance's and the variance's through the mean) and recomputes no statistic: the
    norms keep what rsqrt's derivative reads (keeping rsqrt's output cost one more psum per norm)."""
    import re

    from jaxhybrid.model.layers import Ops
    from jaxhybrid.parallel.tensor.ops import TensorOps

    mesh = make_mesh(ParallelDims.from_mesh_shape((1, 2, 2, 2)))
    tops = TensorOps.build(mesh, n_heads=4, kv_heads=4)
    k = jax.random.split(jax.random.key(0), 4)
    x, dy = jax.random.normal(k[0], (4, 8, 16)), jax.random.normal(k[1], (4, 8, 16))
    s, b = 1.0 + jax.random.normal(k[2], (16,)), jax.random.normal(k[3], (16,))
    args = (x, s, b) if kind == "layer_norm" else (x, s)
    fn = lambda ops: lambda *a: getattr(ops, kind)(*a, 1e-5)  # noqa: E731
    y, vjp = jax.vjp(fn(tops), *args)
    y_r, vjp_r = jax.vjp(fn(Ops()), *args)
    assert_tree_close((y, vjp(dy)), (y_r, vjp_r(dy)), "fp32_kernel", kind)
    row = lambda jaxpr: len(re.findall(r"psum\w*\[axes=\('row',\)", str(jaxpr)))  # noqa: E731
    assert (row(jax.make_jaxpr(fn(tops))(*args)), row(jax.make_jaxpr(vjp)(dy))) == row_psums


def test_bench_tensor_checks_every_grid_before_compiling(monkeypatch):
    """``bench tensor``: a malformed --only / --ladder-shape is an argparse error naming it, and a grid
    that does not cover JAX's devices fails before the first factorization compiles (not minutes later)."""
    import argparse

    from jaxhybrid.bench import tensor as bt

    assert bt.grid_shapes("1,2,2,2;2,1,2,2") == [(1, 2, 2, 2), (2, 1, 2, 2)]
    for bad in ("abc", "1,1", "1,0,2,2", "1,2,2,2;"):
        with pytest.raises(argparse.ArgumentTypeError, match="G_data,G_d,G_r,G_c"):
            bt.grid_shapes(bad)
    monkeypatch.setattr(bt, "_engine", lambda *a, **k: pytest.fail("compiled"))
    p = argparse.ArgumentParser()
    bt.add_arguments(p)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"grid 1,1,1,{n + 1} has {n + 1} devices, not the {n} JAX has"):
        bt.run(p.parse_args(["--only", f"1,1,1,{n};1,1,1,{n + 1}"]))


def test_bench_tensor_tables_put_measured_bytes_beside_the_equations():
    """Without --json, ``bench tensor`` prints tables: a factorization's measured dense bytes, AxoNN's
    eqs. 4-7 and their ratio in one row; the A-E ladder with speedups, and on CPU why they are not overlap."""
    from jaxhybrid.bench import tensor as bt

    row = {"shape": {"data": 2, "depth": 1, "row": 2, "col": 2}, "step_s": 0.0125,
           "dense_tensor_axes_measured": 150, "dense_tensor_axes_eqs_4_7": 100,
           "grad_allreduce_data_depth_measured": 7, "grad_allreduce_eq_8_dense_only": 5,
           "relayout_without_A": 0, "outside_eqs_4_8": 3}
    cols = bt._row_line(row).split()
    assert cols == ["2", "1", "2", "2", "12.500", "150", "100", "1.500", "7", "5", "0", "3"]
    assert len(bt._ROW_HEAD.split()) == len(cols)
    opt = {"shape": [1, 2, 2, 2], "remat": "full", "step_s": {"baseline": 0.02, "A": 0.01},
           "speedup_vs_baseline": {"baseline": 1.0, "A": 2.0},
           "async_collectives_overlapping_compute": {"baseline": 0, "A": 0}}
    lines = bt._ladder_lines(opt, "cpu").splitlines()
    assert lines[3].split() == ["A", "10.000", "2.000", "0"] and "XLA:CPU" in lines[-1]
    assert "XLA:CPU" not in bt._ladder_lines(opt, "gpu")
