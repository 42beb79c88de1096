"""Input checks of a :class:`~jaxhybrid.parallel.twobp.stage.Stage`'s kernels, made before any compilation:
parameters (the stage's slice, float32 masters or the compute copy), activations or tokens, targets, and
the cotangent against the forward output it belongs to. Each error names the values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.parallel.twobp.residuals import Residuals


class StageChecks:
    """Mixed into the stage kernels, which supply ``cfg``, ``model``, ``param_names``, ``is_first`` and
    ``is_last``, and call :meth:`_init_checks` once."""

    def _init_checks(self) -> None:
        self._params_treedef = jax.tree.structure(None)  # the param structure _check_params last accepted
        self._param_dtypes = {np.dtype("float32"), np.dtype(self.model.dtype)}  # masters, compute copy
        self._acc_layouts: set = set()  # (treedef, leaf shapes and dtypes) of gradient sums accepted

    def _check_params(self, params):
        """Params are the stage's slice, all float32 masters or all in the compute dtype (the offloaded
        optimizer keeps the masters on host and hands the stage its compute copy, Myelin V-B)."""
        # Fast path for a structure already accepted (the hot per-microbatch calls): a flatten and a dtype
        # compare per leaf instead of the key paths that only the error message needs.
        leaves, treedef = jax.tree.flatten(params)
        dtypes = {getattr(v, "dtype", None) for v in leaves}
        if treedef == self._params_treedef and len(dtypes) == 1 and dtypes <= self._param_dtypes:
            return
        if not isinstance(params, dict) or sorted(params) != sorted(self.param_names):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"{self!r} expects params {sorted(self.param_names)}, got {got}; use slice_params")
        found = {}
        for k, v in jax.tree_util.tree_flatten_with_path(params)[0]:
            found.setdefault(str(jnp.dtype(v.dtype)), []).append(jax.tree_util.keystr(k))
        allowed = sorted({str(d) for d in self._param_dtypes})
        if len(found) > 1 or not set(found) <= set(allowed):
            raise ValueError(f"stage params must all be {' or '.join(allowed)} (float32 masters, or the compute copy of "
                             f"the offloaded optimizer); got " + "; ".join(f"{d}: {p[:3]}" for d, p in found.items()))
        self._params_treedef = treedef

    def _check_inputs(self, params, x, targets):
        self._check_params(params)
        c, dt = self.cfg, jnp.dtype(self.model.dtype)
        x = jnp.asarray(x)
        if self.is_first:
            if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"first stage takes int tokens [mb, T]; got {x.dtype} {tuple(x.shape)}")
            x = x.astype(jnp.int32)
        elif x.ndim != 3 or x.shape[-1] != c.d_model or x.dtype != dt:
            raise ValueError(f"{self!r} takes activations [mb, T, {c.d_model}] {dt}; got {x.dtype} "
                             f"{tuple(x.shape)} (the stage was built for compute dtype {dt})")
        if x.shape[1] > c.max_seq_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={c.max_seq_len}")
        if self.is_last:
            if targets is None:
                raise ValueError(f"{self!r} is the last stage: forward needs targets int [mb, T]")
            targets = jnp.asarray(targets)
            if targets.shape != x.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
                raise ValueError(f"targets {targets.dtype} {tuple(targets.shape)} must be int {tuple(x.shape[:2])}")
            targets = targets.astype(jnp.int32)
        else:
            targets = None
        return x, targets

    def _check_acc(self, acc, params):
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

    def _check_cotangent(self, res, dy):
        if not isinstance(res, Residuals):
            raise ValueError(f"expected the Residuals returned by forward, got {type(res).__name__}")
        dy = jnp.asarray(dy)
        if tuple(dy.shape) != res.out_shape or str(jnp.dtype(dy.dtype)) != res.out_dtype:
            raise ValueError(f"cotangent {dy.dtype} {tuple(dy.shape)} does not match the forward output "
                             f"{res.out_dtype} {res.out_shape} of {self!r}")
        return dy
