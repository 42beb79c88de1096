"""Collective bytes of the compiled 3D layer equal AxoNN eqs. 4-8 (the planner's comm model).

``jaxhybrid.planner.hlo`` reads every collective of the compiled, SPMD-partitioned HLO; the predicted
volumes come from ``jaxhybrid.planner.comm_model.layer_comm_volumes`` (the planner issue's
implementation of eqs. 4-8), so this is the check of the two against each other.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.parallel.tensor.linear import NORMAL, TRANSPOSED, Linear3D, Switches
from jaxhybrid.parallel.tensor.mesh import factorizations, make_mesh
from jaxhybrid.parallel.tensor.sharding import dense_shapes
from jaxhybrid.planner import hlo
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.tensor import TensorEngine

B, T, K, N = 8, 4, 32, 64


def _layer_hlo(shape, lay):
    mesh = make_mesh(ParallelDims.from_mesh_shape(shape))
    layer = Linear3D(mesh, lay, Switches())
    x = jax.ShapeDtypeStruct((B, T, K), jnp.float32, sharding=NamedSharding(mesh, lay.x_spec()))
    w = jax.ShapeDtypeStruct((K, N), jnp.float32, sharding=NamedSharding(mesh, lay.w_spec))

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(layer, x, w)
        return vjp(y)

    return jax.jit(fwd_bwd).lower(x, w).compile().as_text()


@pytest.mark.parametrize("lay", [NORMAL, TRANSPOSED], ids=["normal", "transposed"])
@pytest.mark.parametrize("shape", factorizations(8), ids=lambda s: "x".join(map(str, s)))
def test_layer_collective_bytes_equal_eqs_4_to_8(shape, lay):
    sizes = ParallelDims.from_mesh_shape(shape).mesh_sizes()
    measured = hlo.totals(hlo.collectives(_layer_hlo(shape, lay), shape))
    predicted = hlo.predicted_layer(B * T // sizes["data"], K, N, sizes, lay.transposed)
    assert measured == predicted


def test_model_dense_sites_match_eqs_4_to_7_and_data_total():
    """In the whole GPT step every dense site's tensor-axis collectives are eqs. 4-7 of its (k, n).

    Gradient all-reduces over data and/or depth are left out here: XLA combines them across layers (eq. 8
    of every layer, plus the bias and norm gradients, which eqs. 4-8 do not model) into one op.
    """
    shape = (1, 2, 2, 2)
    d, dep, r, c = shape
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layers=1", "train.global_batch=8",
                             "data.seq_len=8", f"parallel.data={d}", f"parallel.tensor_depth={dep}",
                             f"parallel.tensor_row={r}", f"parallel.tensor_col={c}"])
    eng = TensorEngine(cfg.model, cfg, compiler_options={"xla_backend_optimization_level": 0})
    text = eng.lower(eng.init_params(jax.random.key(0)), np.zeros((8, 9), np.int32)).compile().as_text()
    measured = hlo.collectives(text, shape)
    sizes = ParallelDims.from_mesh_shape(shape).mesh_sizes()
    for site, (k, n) in dense_shapes(cfg.model).items():
        transposed = site != "head.logits" and eng.ops.layout(site).transposed
        got = hlo.totals(measured, f"axonn_{site}/")
        want = hlo.predicted_layer(8 * 8 // d, k, n, sizes, transposed)
        got, want = ({key: v for key, v in t.items() if hlo.is_tensor_layer_key(key)} for t in (got, want))
        assert got == want, site


def test_parse_iota_groups_and_async_pairs():
    line = ('%ag = f32[8,4]{1,0} all-gather-start(f32[4,4]{1,0} %p), channel_id=1, '
            'replica_groups=[4,2]<=[2,2,2]T(1,0,2), dimensions={0}, metadata={op_name="x"}')
    text = line.replace("f32[8,4]{1,0} all-gather-start", "(f32[4,4]{1,0}, f32[8,4]{1,0}) all-gather-start")
    (c,) = hlo.collectives(text, (1, 2, 2, 2))
    # iota [2,2,2] transposed (1,0,2): first group {0, 1} -> devices differing in the last (col) axis.
    assert c.op == "all_gather" and c.axes == ("col",) and c.group_size == 2 and c.buffer_bytes == 64
    sched = "\n".join([line, "%f = f32[8] fusion(%a), kind=kLoop", "%d = f32[8] dot(%a, %b)",
                       "%done = f32[8,4] all-gather-done(%ag)"])
    assert hlo.async_overlap(sched) == [("all_gather", 2)]


@pytest.mark.parametrize("spec", [("data",), ("depth",), (("data", "col"),), ("col",)], ids=str)
def test_combined_allreduce_in_mesh_form_is_read(spec):
    """XLA prints a combined all-reduce's groups as ``mesh['axis_0'=2,...], device_ids=([..]T(..))
    {'axis_0'}``; before this form was parsed such collectives were dropped (no groups, p = 1), so the
    gradient reductions the combiner merges were missing from every byte count."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(ParallelDims.from_mesh_shape((2, 2, 1, 2)))
    split = NamedSharding(mesh, P(*spec))
    f = jax.jit(lambda a, b: (a.sum(0), b.sum(0)), in_shardings=(split, split),
                out_shardings=NamedSharding(mesh, P()))
    text = f.lower(jnp.ones((8, 4)), jnp.ones((8, 3))).compile().as_text()
    assert "replica_groups=mesh[" in text  # the form under test (jax 0.10.2's XLA)
    (c,) = hlo.collectives(text, (2, 2, 1, 2))
    axes = tuple(a for s in spec for a in (s if isinstance(s, tuple) else (s,)))
    assert (c.op, c.axes, c.buffer_bytes) == ("all_reduce", axes, (4 + 3) * 4)


@pytest.mark.parametrize("microbatches,dtype", [(2, "float32"), (4, "float32"), (4, "bfloat16"), (2, "bfloat16")])
def test_microbatches_reduce_every_gradient_over_data_once_after_the_scan(microbatches, dtype):
    """AxoNN eq. 8 once per step where it moves fewer bytes (config.reduce_data_once: M x dtype bytes > 4):
    the compiled step then has no collective over the data axis inside its scan, and the ones after it
    move each device's float32 gradients exactly once (plus the replicas' losses, 4 bytes), whatever M.
    bfloat16 at M = 2 keeps each layer's reduction in its backward (2 x 2 bytes, and it may overlap)."""
    shape = (2, 2, 1, 2)
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layers=2", "train.global_batch=16", "data.seq_len=8",
                             "parallel.data=2", "parallel.tensor_depth=2", "parallel.tensor_col=2",
                             f"pipeline.microbatches={microbatches}", f"precision.compute_dtype={dtype}"])
    eng = TensorEngine(cfg.model, cfg)
    params = eng.init_params(jax.random.key(0))
    batch = np.zeros((16, 9), np.int32)
    data = [c for c in hlo.collectives(eng.lower(params, batch).compile().as_text(), shape) if "data" in c.axes]
    in_loop = [c for c in data if "while/body" in c.op_name]
    if microbatches * np.dtype(jnp.dtype(dtype)).itemsize <= 4:
        assert in_loop
        return
    assert data and not in_loop
    local = sum(a.addressable_shards[0].data.size * 4 for a in jax.tree.leaves(params))
    assert sum(c.buffer_bytes for c in data) == local + 4


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_qkv_split_is_local_with_heads_over_column(model):
    """The fused qkv kernel's columns are grouped per key/value head (model.transformer.PARAM_LAYOUT), so
    the qkv layer's contiguous column blocks hold whole groups and splitting q, k and v moves nothing: no
    collective-permute or all-to-all in the step (with [q | k | v] columns they were a third of gpt-tiny's
    tensor-parallel bytes on this mesh)."""
    shape = (2, 1, 2, 2)
    cfg = load_config(None, [f"model.name={model}", "model.n_layers=2", "train.global_batch=8", "data.seq_len=32",
                             "parallel.data=2", "parallel.tensor_row=2", "parallel.tensor_col=2"])
    eng = TensorEngine(cfg.model, cfg)
    assert eng.ops.head_axis == "col"
    params = eng.init_params(jax.random.key(0))
    ops = {c.op for c in hlo.collectives(eng.lower(params, np.zeros((8, 33), np.int32)).compile().as_text(), shape)}
    assert ops and not ops & {"collective_permute", "all_to_all"}, ops
