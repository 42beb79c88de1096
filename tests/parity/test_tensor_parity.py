"""AxoNN 4D parity: one training step on the (data, depth, row, col) mesh equals the single-device step.

Every factorization of the 8 fake devices into (G_data, G_d, G_r, G_c) runs one step of a one-block tiny
GPT with optimization A on; a one-block tiny LLaMA (RMSNorm, RoPE, GQA, SwiGLU, untied head) and the GPT
with A off run a subset of them (``LLAMA``, ``NO_A``). Loss, gradients and the parameters after one AdamW
step are compared leaf by leaf.

AdamW's first step is ``lr * g / (|g| + eps)``: with the default eps 1e-8 it is ``lr * sign(g)``, which
turns rounding noise on a gradient that is zero in exact arithmetic (the key bias of attention: softmax is
invariant to it) into a full step of either sign. More generally a gradient error ``d`` moves the update
by ``eps / (|g| + eps)^2 * d``, largest where ``|g|`` is near eps, while the comparison is relative to the
largest update: with eps = 1e-3 a 7e-7 gradient error (relative to max |g|) became 1.1e-5 on the
mlp_down bias (element |g| = 1.4e-3), and which element sits near eps shifts with 1e-8 changes of the
initial parameters. The test uses eps = 0.1 (amplification at most ``max|g| / (eps max|u|)``, about 3
here) so that the comparison measures the layout, not Adam's conditioning. And lr = 0.5: at a usual
1e-3 one step moved a leaf by 1e-5 to 2e-3 of its largest value, so the parameters after it agreed with
a step that skipped a norm scale's update or halved the weight decay.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxhybrid.model import Model
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim import device_updater
from jaxhybrid.parallel.tensor.mesh import factorizations
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.engines.base import LocalEngine
from jaxhybrid.runtime.engines.tensor import TensorEngine

FACTORS = factorizations(8)
FAST = {"xla_backend_optimization_level": 0}
BATCH = np.random.RandomState(0).randint(0, 256, (8, 9)).astype(np.int32)


def _cfg(model: str, shape=(1, 1, 1, 1), letters: str = "ABCDE", microbatches: int = 1, extra: tuple = ()):
    d, dep, r, c = shape
    return load_config(None, [f"model.name={model}", "model.n_layers=1", "train.global_batch=8",
                              "data.seq_len=8", f"parallel.data={d}", f"parallel.tensor_depth={dep}",
                              f"parallel.tensor_row={r}", f"parallel.tensor_col={c}",
                              f"tensor.optimizations={letters}", "optim.warmup_steps=0", "optim.eps=0.1", "optim.lr=0.5",
                              f"pipeline.microbatches={microbatches}", *extra])


def _one_step(engine, cfg, params):
    loss, grads = engine.loss_and_grads(params, BATCH, 1.0)
    # Gradients come back in the parameters' own shardings (the trainer's optimizer relies on it).
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim)
    val = engine.eval_loss(params, BATCH)  # forward only (validation) on the step's tokens
    host = jax.device_get((params, loss, grads))  # the update donates params
    upd = device_updater(cfg)
    state = upd.init(params)
    sq, nonfinite = upd.stats(grads)
    new, _, _ = upd.apply(params, state, grads, 1.0, sq, nonfinite)
    return (*host, jax.device_get(new), jax.device_get(val))


@functools.lru_cache(maxsize=None)
def _reference(model: str):
    cfg = _cfg(model)
    engine = LocalEngine(Model(cfg.model))
    return _one_step(engine, cfg, engine.init_params(jax.random.key(0)))


def _check(model, shape, letters, microbatches=1, extra=()):
    cfg = _cfg(model, shape, letters, microbatches, extra)
    p_ref, l_ref, g_ref, new_ref, v_ref = _reference(model)
    engine = TensorEngine(cfg.model, cfg, compiler_options=FAST)
    # init_params is checked bit-exact in test_tensor_engine; here the cached reference is placed.
    params = jax.device_put(p_ref, engine.shardings)
    _, loss, grads, new, val = _one_step(engine, cfg, params)
    assert_tree_close(loss, l_ref, "fp32_parity", "loss")
    assert_tree_close(v_ref, l_ref, "fp32_parity", "single-device eval loss vs its training loss")
    assert_tree_close(val, l_ref, "fp32_parity", "eval loss")
    assert_tree_close(grads, g_ref, "fp32_parity", "grads")
    assert_tree_close(new, new_ref, "fp32_parity", "params after one step")


# GPT runs all 20 meshes with A. A swaps the layout of every dense layer alike (tensor/linear.py), whatever
# the model around it, and test_tensor_hlo checks both layouts' collectives on every mesh, so A off (only
# meaningful where row x col > 1) and LLaMA (its norms, RoPE, GQA and SwiGLU under the same layer) run the
# meshes that place each axis alone and every pair of them: CI time, not coverage of a code path.
NO_A = [(1, 1, 2, 4), (1, 1, 4, 2), (1, 2, 2, 2), (2, 1, 4, 1), (1, 4, 1, 2)]
LLAMA = [(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (1, 1, 1, 8), (1, 2, 2, 2), (2, 1, 2, 2), (1, 1, 2, 4),
         (1, 1, 4, 2)]
CASES = [("gpt-tiny", s, "ABCDE") for s in FACTORS] + [("gpt-tiny", s, "BCDE") for s in NO_A] + \
    [("llama-tiny", s, "ABCDE") for s in LLAMA]
IDS = [f"{m}-" + "x".join(map(str, s)) + ("-A" if "A" in a else "-noA") for m, s, a in CASES]


@pytest.mark.parametrize("model,shape,letters", CASES, ids=IDS)
def test_step_matches_single_device(model, shape, letters):
    """Loss, gradients and the updated parameters of one training step, leaf by leaf, and the
    forward-only validation loss (fp32_parity)."""
    _check(model, shape, letters)


# With microbatches (float32: M > 1) and data > 1 the engine runs per-replica ops under vmap and reduces over
# data once per step (config.reduce_data_once): every op family (A on and off, LLaMA's norms and RoPE),
# remat full and dots (recomputation under the vmap), B-E off (their barriers) and data with each tensor
# axis, against the same single-device step (two microbatches of 4 rows are its 8 rows).
ONCE = [("gpt-tiny", (2, 1, 2, 2), "ABCDE", ()), ("gpt-tiny", (2, 1, 4, 1), "BCDE", ()),
        ("llama-tiny", (2, 2, 1, 2), "ABCDE", ()), ("gpt-tiny", (4, 1, 1, 2), "ABCDE", ()),
        ("gpt-tiny", (2, 2, 1, 2), "ABCDE", ("train.remat=full",)), ("llama-tiny", (2, 1, 2, 2), "ABCDE", ("train.remat=dots",)),
        ("gpt-tiny", (2, 2, 2, 1), "A", ())]


@pytest.mark.parametrize("model,shape,letters,extra", ONCE,
                         ids=[f"{m}-" + "x".join(map(str, s)) + f"-{a}" + "".join(f"-{e}" for e in x) for m, s, a, x in ONCE])
def test_two_microbatches_reduced_once_match_single_device(model, shape, letters, extra):
    _check(model, shape, letters, 2, extra)


def test_bfloat16_microbatches_reduced_once_match_single_device_bfloat16():
    """bfloat16 with 4 microbatches (per layer would move 4 x 2 bytes per gradient: the engine reduces
    float32 once) against the single-device bfloat16 step over the same 4 microbatches."""
    extra = ("precision.compute_dtype=bfloat16",)
    cfg = _cfg("gpt-tiny", (2, 1, 2, 2), "ABCDE", 4, extra)
    ref = LocalEngine(Model(cfg.model, compute_dtype="bfloat16"), microbatches=4)
    params = ref.init_params(jax.random.key(0))
    l_ref, g_ref = jax.device_get(ref.loss_and_grads(params, BATCH, 1.0))
    engine = TensorEngine(cfg.model, cfg, compiler_options=FAST)
    loss, grads = jax.device_get(engine.loss_and_grads(jax.device_put(params, engine.shardings), BATCH, 1.0))
    assert_tree_close(loss, l_ref, "bf16_parity", "loss")
    assert_tree_close(grads, g_ref, "bf16_parity", "grads")


def test_factorizations_cover_the_search_space():
    assert len(FACTORS) == 20 and len(set(FACTORS)) == 20 and set(NO_A + LLAMA) <= set(FACTORS)
    assert all(int(np.prod(f)) == 8 for f in FACTORS)
