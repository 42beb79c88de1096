"""The step model's tensor-parallel terms against what the engines run: where the all-gathered weights
live (AxoNN Alg. 1 line 13, optimization E), the head's collectives (eq. 9 over every layer), and the
data all-reduce of the whole-model engine (eq. 8 per layer with one microbatch, once per step in float32
with several)."""
import jax
import numpy as np
import pytest

from jaxhybrid.core.config.model import PRESETS, block_matmuls
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.model import Model
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.parallel.tensor.local import LocalTensor
from jaxhybrid.parallel.twobp.stage import Stage
from jaxhybrid.planner.comm_model import comm_time, group_bandwidths, layer_comm_volumes
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.memory import optimal_checkpoint_interval
from jaxhybrid.planner.plan import machine_from_hardware
from jaxhybrid.planner.step_model import Layout, block_bytes_per_device, evaluate, gathered_weights
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.tensor import TensorEngine

GATHER = "stablehlo.all_gather"


def _cfg(*extra):
    return load_config(None, ["model.name=gpt-tiny", "model.n_layers=2", "train.global_batch=8", "data.seq_len=8",
                              "parallel.tensor_depth=2", *extra])


def _machine():
    return machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", 0.5)


@pytest.mark.parametrize("letters", ["ABCDE", "ABCD"])
def test_whole_model_engine_gathers_again_where_the_model_says(letters):
    """TensorEngine on depth 2: the lowered step gathers each dense site's W once, and once more in the
    backward exactly where ``gathered_weights`` says the W is neither kept nor cached."""
    counts, sites = {}, None
    for remat in ("none", "dots", "full"):
        cfg = _cfg(f"train.remat={remat}", f"tensor.optimizations={letters}")
        sites = cfg.model.n_layers * len(block_matmuls(cfg.model))
        eng = TensorEngine(cfg.model, cfg, devices=jax.devices()[:2])
        lowered = eng.lower(eng.init_params(jax.random.key(0)), np.zeros((8, 9), np.int32))
        counts[remat] = lowered.as_text().count(GATHER)
    for remat in ("dots", "full"):
        g = gathered_weights(Layout(ParallelDims(1, 1, 1, 1, 2), 8, 1, "1f1b", False, False, remat), letters)
        again = 0 if (g["kept"] or g["cached_full"]) else sites
        assert counts[remat] == counts["none"] + again, (remat, letters, counts)


@pytest.mark.parametrize("remat,letters", [("dots", "ABCDE"), ("dots", "ABCD"), ("full", "ABCDE")])
def test_pipeline_stage_gathers_again_where_the_model_says(remat, letters):
    """A hybrid stage (depth 2): dots with E keeps the gathered W in its vjp (the input pass gathers
    nothing) and without E gathers each again; full's segments gather every W again."""
    cfg = _cfg(f"train.remat={remat}", "parallel.pipeline=2", "pipeline.microbatches=2", "model.n_layers=4",
               "data.seq_len=32", f"tensor.optimizations={letters}")
    local = LocalTensor.from_config(cfg, devices=jax.devices()[:2])
    stage = Stage(Model(cfg.model, local.ops), 1, 3, remat=remat)
    params = stage.init_params(jax.random.key(0), local.param_shardings)
    x = np.random.default_rng(0).standard_normal((4, 32, cfg.model.d_model)).astype(np.float32)
    _, res = stage.forward(params, x, None)
    regathers = stage.kernels.input_program.lower(*stage.kernels.input_args(res, np.ones_like(x))).as_text().count(GATHER)
    g = gathered_weights(Layout(ParallelDims(2, 1, 1, 1, 2), 4, 2, "1f1b", False, False, remat), letters)
    assert not g["cached_full"]
    assert regathers == (0 if g["kept"] else 2 * len(block_matmuls(cfg.model))), (remat, regathers)
    ref = Stage(Model(cfg.model), 1, 3, remat=remat)
    got = []
    for st, p in ((ref, jax.tree.map(np.asarray, params)), (stage, params)):
        _, r = st.forward(p, x, None)
        dx, wr = st.backward_input(r, np.ones_like(x))
        got.append(jax.tree.map(np.asarray, (dx, st.backward_weight(p, wr))))
    assert_tree_close(got[1], got[0], "fp32_parity", f"remat {remat} stage with {letters} on depth 2")


def test_optimization_e_saves_the_regather_and_keeps_every_gathered_weight():
    """remat full on a whole-model mesh: E removes the backward's all-gathers (M x blocks x eq. 4) and keeps
    all n blocks' gathered W through the step instead of the ac of one recomputed segment."""
    cfg, m, seq = PRESETS["gpt2-1.3b"], _machine(), 1024
    lay = Layout(ParallelDims(1, 1, 1, 2, 4), 4, 8, "1f1b", False, False, "full")
    on, off = (evaluate(cfg, lay, m, seq, letters=lt) for lt in ("ABCDE", "ABCD"))
    bw = group_bandwidths(m.net, 1, 2, 4, 1)
    ag = sum(comm_time(layer_comm_volumes(4 * seq, k, n, 1, 2, 4, 1, tr), bw, 2)["all_gather"]
             for k, n, tr in block_matmuls(cfg))
    assert off["predicted_step_s"] - on["predicted_step_s"] == pytest.approx(8 * cfg.n_layers * ag, rel=1e-9)
    g = block_bytes_per_device(cfg, lay, seq, 2, flash=False)["gathered_w"]
    ac = optimal_checkpoint_interval(cfg.n_layers, 1)
    assert on["memory_per_device_bytes"] - off["memory_per_device_bytes"] == \
        pytest.approx((cfg.n_layers - min(ac, cfg.n_layers)) * g, rel=1e-9)


def test_head_collectives_and_data_allreduce_once_per_step_are_counted():
    """One stage on a (data 2, col 2, row 2) mesh: comm_s is M x (every block's and the head's eqs. 4-7)
    plus the data all-reduce: with one microbatch each layer's backward runs eq. 8 in the compute dtype
    (bf16 here); with 8 the engine reduces its accumulated float32 gradients once after its scan
    (test_tensor_hlo checks the compiled program), twice the bytes of one bf16 pass, not 8 times; replicas
    that are MPI ranks (a pipeline) reduce float32 once per step."""
    cfg, m, seq = PRESETS["gpt2-small"], _machine(), 1024
    bw = group_bandwidths(m.net, 2, 2, 1, 2)
    layers = [(k, n, tr) for k, n, tr in block_matmuls(cfg)] * cfg.n_layers + [(cfg.d_model, cfg.vocab_size, False)]
    tensor = data = 0.0
    for k, n, tr in layers:
        t = comm_time(layer_comm_volumes(2 * seq, k, n, 2, 2, 1, 2, tr), bw, 2)
        tensor += t["all_gather"] + t["all_reduce_fwd"] + t["all_reduce_bwd"] + t["reduce_scatter"]
        data += t["all_reduce_data"]
    one = evaluate(cfg, Layout(ParallelDims(1, 2, 2, 2, 1), 2, 8, "1f1b", False, False, "none"), m, seq)
    assert one["data_allreduce_s"] == pytest.approx(2 * data, rel=1e-9)
    assert one["comm_s"] == pytest.approx(8 * tensor + 2 * data, rel=1e-9)
    once = evaluate(cfg, Layout(ParallelDims(1, 2, 2, 2, 1), 16, 1, "1f1b", False, False, "none"), m, seq)
    assert once["data_allreduce_s"] == pytest.approx(data, rel=1e-9)
    piped = [evaluate(cfg, Layout(ParallelDims(2, 2, 1, 1, 1), 2, k, "1f1b", False, False, "none"), m,
                      seq)["data_allreduce_s"] for k in (1, 8)]
    assert piped[0] == piped[1] > 0
