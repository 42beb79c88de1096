"""Input checks of a :class:`~jaxhybrid.parallel.twobp.stage.Stage`'s kernels, made before any compilation:
parameters (the stage's slice, float32 masters or the compute copy), activations or tokens, targets, the
cotangent against the forward output it belongs to, and the weight residuals of 2BP's backward-p2. Each
error names the values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.layout import StageLayout
from jaxhybrid.parallel.twobp.residuals import Residuals, WeightResiduals


class StageChecks:
    """The checks of one stage's inputs. It remembers the parameter structure and gradient-sum layouts
    it accepted, so the per-microbatch calls of a pipeline pay a flatten and a compare, not the full check."""

    def __init__(self, layout: StageLayout):
        self.layout = layout
        self._params_treedef = jax.tree.structure(None)  # the param structure params() last accepted
        self._param_dtypes = {np.dtype("float32"), np.dtype(layout.model.dtype)}  # masters, compute copy
        self._acc_layouts: set = set()  # (treedef, leaf shapes and dtypes) of gradient sums accepted

    def params(self, params) -> None:
        """Params are the stage's slice, all float32 masters or all in the compute dtype (the offloaded
        optimizer keeps the masters on host and hands the stage its compute copy, Myelin V-B)."""
        # Fast path for a structure already accepted (the hot per-microbatch calls): a flatten and a dtype
        # compare per leaf instead of the key paths that only the error message needs.
        leaves, treedef = jax.tree.flatten(params)
        dtypes = {getattr(v, "dtype", None) for v in leaves}
        if treedef == self._params_treedef and len(dtypes) == 1 and dtypes <= self._param_dtypes:
            return
        names = self.layout.param_names
        if not isinstance(params, dict) or sorted(params) != sorted(names):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"{self.layout!r} expects params {sorted(names)}, got {got}; use slice_params")
        found = {}
        for k, v in jax.tree_util.tree_flatten_with_path(params)[0]:
            found.setdefault(str(jnp.dtype(v.dtype)), []).append(jax.tree_util.keystr(k))
        allowed = sorted({str(d) for d in self._param_dtypes})
        if len(found) > 1 or not set(found) <= set(allowed):
            raise ValueError(f"stage params must all be {' or '.join(allowed)} (float32 masters, or the compute copy of "
                             f"the offloaded optimizer); got " + "; ".join(f"{d}: {p[:3]}" for d, p in found.items()))
        self._params_treedef = treedef

    def inputs(self, params, x, targets):
        """Params, then the stage's input (int tokens on the first stage, activations in the compute dtype
        elsewhere) and the last stage's targets; returns ``(x, targets)`` as the kernels take them."""
        self.params(params)
        lay = self.layout
        c, dt = lay.cfg, jnp.dtype(lay.model.dtype)
        x = jnp.asarray(x)
        if lay.is_first:
            if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"first stage takes int tokens [mb, T]; got {x.dtype} {tuple(x.shape)}")
            x = x.astype(jnp.int32)
        elif x.ndim != 3 or x.shape[-1] != c.d_model or x.dtype != dt:
            raise ValueError(f"{lay!r} takes activations [mb, T, {c.d_model}] {dt}; got {x.dtype} "
                             f"{tuple(x.shape)} (the stage was built for compute dtype {dt})")
        if x.shape[1] > c.max_seq_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={c.max_seq_len}")
        if lay.is_last:
            if targets is None:
                raise ValueError(f"{lay!r} is the last stage: forward needs targets int [mb, T]")
            targets = jnp.asarray(targets)
            if targets.shape != x.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
                raise ValueError(f"targets {targets.dtype} {tuple(targets.shape)} must be int {tuple(x.shape[:2])}")
            targets = targets.astype(jnp.int32)
        else:
            targets = None
        return x, targets

    def acc(self, acc, params) -> None:
        """A running gradient sum has the params' structure, shapes and dtypes (a kernel adds to it).
        Per microbatch in a pipeline: one flatten of ``acc`` against the layouts already accepted."""
        if acc is None:
            return
        leaves, treedef = jax.tree.flatten(acc)
        sig = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        if sig in self._acc_layouts:
            return
        p_leaves, p_def = jax.tree.flatten(params)
        if sig != (p_def, tuple((y.shape, y.dtype) for y in p_leaves)):
            raise ValueError(f"acc must be a gradient sum shaped like the stage's params; got {treedef} with "
                             f"{[(tuple(x.shape), str(x.dtype)) for x in leaves[:3]]}... for params "
                             f"{[(tuple(y.shape), str(y.dtype)) for y in p_leaves[:3]]}...")
        self._acc_layouts.add(sig)

    def cotangent(self, res, dy):
        """``dy`` matches the shape and dtype of the forward output whose ``Residuals`` come with it."""
        if not isinstance(res, Residuals):
            raise ValueError(f"expected the Residuals returned by forward, got {type(res).__name__}")
        dy = jnp.asarray(dy)
        if tuple(dy.shape) != res.out_shape or str(jnp.dtype(dy.dtype)) != res.out_dtype:
            raise ValueError(f"cotangent {dy.dtype} {tuple(dy.shape)} does not match the forward output "
                             f"{res.out_dtype} {res.out_shape} of {self.layout!r}")
        return dy

    @staticmethod
    def weight_residuals(weight_residuals) -> list[WeightResiduals]:
        """backward-p2's input as a non-empty list of ``WeightResiduals`` of one layout (one microbatch,
        a concatenated batch, or a list or tuple of microbatches)."""
        wrs = list(weight_residuals) if isinstance(weight_residuals, (list, tuple)) else [weight_residuals]
        bad = sorted({type(w).__name__ for w in wrs if not isinstance(w, WeightResiduals)})
        if bad or not wrs:
            raise ValueError(f"backward_weight needs WeightResiduals or a non-empty list of them, got "
                             f"{type(weight_residuals).__name__}{' of ' + ', '.join(bad) if bad else ''}")
        rs.check_one_layout(wrs)
        return wrs
