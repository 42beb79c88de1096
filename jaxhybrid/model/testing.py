"""Parity helpers: the one place that defines tolerances, and tree comparisons that raise.

Every parallel feature is checked against the single-device reference with :func:`assert_tree_close`,
which names the pytree path of the first leaf that differs. It raises; it never returns a bool.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxhybrid.model.transformer import qkv_groups

# Relative tolerances (max |a-b| / max(|b|, tiny) per leaf), by what is compared.
TOLERANCES = {
    "fp32_kernel": 1e-6,   # a split/fused kernel against jax.vjp of the same function
    "fp32_parity": 1e-5,   # a parallel layout against the single-device run
    "bf16_parity": 2e-2,   # bfloat16 compute against float32, or against another bfloat16 program
    # A bfloat16 pipeline job's first loss against the single-device Model.loss in bfloat16 compute (the
    # stages' microbatch programs round differently): a few 1e-6 apart when correct, while a corrupted
    # received activation (its position 0 zeroed) puts the loss well past this bound.
    "bf16_loss": 2e-5,
    "fp16_parity": 1e-3,   # float16 compute against float32: about one float16 ulp of the leaf's largest value
    "exact": 0.0,          # bit for bit
}


def rel_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    denom = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-30)
    return float(np.max(np.abs(a - b))) / denom if a.size else 0.0


def max_rel_err(a, b) -> float:
    """Largest per-leaf relative error between two pytrees of the same structure (ValueError otherwise: a
    leaf missing from one side must not read as agreement)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError(f"tree structures differ:\n  {jax.tree.structure(a)}\n  {jax.tree.structure(b)}")
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max((rel_err(x, y) for x, y in zip(la, lb)), default=0.0)


def assert_tree_close(actual, expected, tol: float | str = "fp32_parity", what: str = "") -> None:
    """Raise AssertionError naming the first pytree path whose relative error exceeds ``tol``."""
    rtol = TOLERANCES[tol] if isinstance(tol, str) else float(tol)
    pa = jax.tree_util.tree_flatten_with_path(actual)[0]
    pe, te = jax.tree_util.tree_flatten_with_path(expected)
    sa = jax.tree.structure(actual)
    if sa != te:
        raise AssertionError(f"{what}: tree structures differ:\n  actual   {sa}\n  expected {te}")
    for (path, a), (_, e) in zip(pa, pe):
        name = jax.tree_util.keystr(path)
        a_np, e_np = np.asarray(a), np.asarray(e)
        if a_np.shape != e_np.shape:
            raise AssertionError(f"{what}{name}: shape {a_np.shape} != expected {e_np.shape}")
        if rtol == 0.0:
            if a_np.dtype != e_np.dtype:
                raise AssertionError(f"{what}{name}: dtype {a_np.dtype} != expected {e_np.dtype}")
            if a_np.reshape(-1).view(np.uint8).tobytes() != e_np.reshape(-1).view(np.uint8).tobytes():
                diff = rel_err(a_np, e_np)
                raise AssertionError(f"{what}{name}: not bit-identical (relative error {diff:.3e})")
            continue
        err = rel_err(a_np, e_np)
        if not err <= rtol:
            raise AssertionError(f"{what}{name}: relative error {err:.3e} > tolerance {rtol:.1e}")


def without_key_bias(tree, model) -> Any:
    """``tree`` (float32 numpy leaves) with the key part of every qkv bias zeroed, for ``model`` (a
    :class:`~jaxhybrid.core.config.model.ModelConfig`; the fused qkv bias, grouped ``[q_g | k_g | v_g]`` per
    key/value head as :data:`~jaxhybrid.model.transformer.PARAM_LAYOUT` says). Its true gradient is
    zero (softmax does not change when one constant is added to every score of a row), so it holds
    summation-order noise that AdamW's normalisation scales to learning-rate-sized steps, so after a few
    steps it is far further apart than every other leaf. Parity tests of AdamW runs whose reduction order
    differs leave it out."""

    def zero_keys(path, x):
        x = np.array(x, np.float32)
        name = jax.tree_util.keystr(path)
        if "qkv" in name and "bias" in name and x.ndim == 1:
            x.reshape(qkv_groups(model))[:, -2] = 0
        return x

    return jax.tree_util.tree_map_with_path(zero_keys, tree)

