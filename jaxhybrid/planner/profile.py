"""Profiled costs: time the jitted 2BP stage kernels of a model on the current device.

One chain layer per transformer block (the embedding joins the first block, the head and loss the last,
as in the pipeline's stages). Blocks in the middle are identical, so one middle block is timed and
reused. Each figure is the median of ``repeats`` ``block_until_ready`` timings after a warm-up call.
``activation_bytes`` is the block's output (MadPipe's a_l: what crosses a stage boundary); ``stored_bytes``
what its forward keeps for its backward (``Stage.residual_bytes``), where MadPipe would count its input.
"""
from __future__ import annotations

import time

import numpy as np

from jaxhybrid.planner.costs import LayerCost, Profile


def _median_time(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def _time_stage(model, lo: int, hi: int, mb: int, seq: int, repeats: int) -> LayerCost:
    import jax
    import jax.numpy as jnp

    from jaxhybrid.parallel.twobp.residuals import tree_bytes
    from jaxhybrid.parallel.twobp.stage import Stage

    stage = Stage(model, lo, hi)
    params = stage.init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    cfg = model.cfg
    x = (jnp.asarray(rng.integers(0, cfg.vocab_size, (mb, seq)), jnp.int32) if stage.is_first
         else jnp.asarray(rng.standard_normal((mb, seq, cfg.d_model)), model.dtype))
    tgt = jnp.asarray(rng.integers(0, cfg.vocab_size, (mb, seq)), jnp.int32) if stage.is_last else None
    y, res = stage.forward(params, x, tgt)
    dy = jnp.ones_like(y) if stage.is_last else jnp.asarray(rng.standard_normal(y.shape), y.dtype)
    _, wr = stage.backward_input(res, dy)
    fwd = _median_time(stage.forward, params, x, tgt, repeats=repeats)
    bwd = _median_time(stage.backward, res, dy, repeats=repeats)
    bwi = _median_time(stage.backward_input, res, dy, repeats=repeats)
    bww = _median_time(stage.backward_weight, params, wr, repeats=repeats)
    out_bytes = 0 if stage.is_last else mb * seq * cfg.d_model * np.dtype(model.dtype).itemsize
    return LayerCost(f"blocks[{lo}:{hi})", fwd, bwd, float(tree_bytes(params)), float(out_bytes), bwi, bww,
                     float(stage.residual_bytes(res)))


def profile_model(model_cfg, microbatch: int, seq: int, dtype: str = "float32", repeats: int = 3) -> Profile:
    """A :class:`Profile` of ``model_cfg`` for microbatches of ``microbatch x seq`` tokens."""
    from jaxhybrid.model import Model

    n = model_cfg.n_layers
    if microbatch < 1 or seq < 1 or repeats < 1 or seq > model_cfg.max_seq_len:
        raise ValueError(f"microbatch={microbatch}, repeats={repeats} must be >= 1 and seq={seq} in "
                         f"[1, max_seq_len={model_cfg.max_seq_len}]")
    model = Model(model_cfg, compute_dtype=dtype)
    first = _time_stage(model, 0, 1, microbatch, seq, repeats)
    if n == 1:
        layers = [first]
    else:
        last = _time_stage(model, n - 1, n, microbatch, seq, repeats)
        middle = [_time_stage(model, 1, 2, microbatch, seq, repeats)] if n > 2 else []
        layers = [first] + [LayerCost(f"blocks[{i}:{i + 1})", *[getattr(middle[0], f) for f in
                            ("forward_s", "backward_s", "weight_bytes", "activation_bytes", "backward_input_s",
                             "backward_weight_s", "stored_bytes")]) for i in range(1, n - 1)] + [last]
    return Profile(float(microbatch * seq * 4), tuple(layers))
