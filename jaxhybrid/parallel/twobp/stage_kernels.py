"""The jitted kernels of a :class:`~jaxhybrid.parallel.twobp.stage.Stage` and their public wrappers (input checks,
residual bookkeeping, the summed weight pass's chunks, the whole-stage ``custom_vjp``). What each kernel
computes is in :mod:`jaxhybrid.parallel.twobp.stage_passes`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxhybrid.parallel.twobp import backprop as bp
from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.residuals import Residuals, WeightResiduals
from jaxhybrid.parallel.twobp.stage_passes import StagePasses

# Most microbatches per summed weight-pass program; more run as several programs, each adding the
# running sum. Why: its compile time grows with K (4-block gpt-small-cpu stage: 0.3 s at K=1, 1.3 s at 8,
# 2.1 s at 16), and a schedule's flush can hold all M microbatches.
SUM_CHUNK = 8


class StageKernels(StagePasses):
    """Kernel construction and the public kernel wrappers; :class:`Stage` supplies the block range."""

    def __init__(self):
        self.trace_counts = {"forward": 0, "backward_input": 0, "backward_weight": 0, "backward_weight_sum": 0,
                             "backward": 0}
        saved = self.remat != "full"
        self._fwd = jax.jit(self._forward_saved if saved else self._forward_segments)
        self._bi = jax.jit(self._bi_saved if saved else self._bi_segments)
        # acc (a running gradient sum) is donated: the result reuses its buffers.
        self._bw = jax.jit(self._bw_kernel, donate_argnames="acc")
        self._bw_sum = jax.jit(self._bw_sum_kernel, donate_argnames="acc")
        self._fused = jax.jit(self._fused_kernel, donate_argnames="acc")
        # Forward only (validation): the plain tape keeps nothing for a backward.
        self._eval = jax.jit(lambda p, x, t: self._run(bp.Tape("plain"), p, x, t, self.first_block,
                                                       self.last_block, self.is_first, self.is_last))
        self._fn = None
        self._init_checks()

    # ---- public API -------------------------------------------------------------------------------------
    def forward(self, params, x, targets=None):
        """Run the stage on one microbatch. First stage: ``x`` int32 tokens ``[mb, T]``; others:
        activations ``[mb, T, d]`` in the compute dtype. Last stage: returns the mean loss (float32 scalar)
        over the microbatch and needs ``targets`` int32 ``[mb, T]``. Returns ``(y, residuals)``."""
        x, targets = self._check_inputs(params, x, targets)
        if self.remat == "full":
            y, keep = self._fwd(params, x, targets)
            res = Residuals(params, seg_inputs=[x] + list(keep), targets=targets)
        else:
            y, vjp, records, idx = self._fwd(params, x, targets)
            res = Residuals(params, vjp=vjp, records=records, site_index=idx.value)
        return y, dataclasses.replace(res, out_shape=tuple(y.shape), out_dtype=str(jnp.dtype(y.dtype)))

    def evaluate(self, params, x, targets=None):
        """Forward only, keeping no residuals (validation): inputs and output as in :meth:`forward`."""
        x, targets = self._check_inputs(params, x, targets)
        return self._eval(params, x, targets)

    def _bi_args(self, residuals: Residuals, dy) -> tuple:
        """The input-pass kernel's arguments for either residual layout (segment inputs or saved vjp)."""
        if self.remat == "full":
            return residuals.params, residuals.seg_inputs, residuals.targets, dy
        return residuals.params, residuals.vjp, dy

    def backward_input(self, residuals: Residuals, dy):
        """2BP backward-p1: ``(dx, weight_residuals)``; ``dx`` is None on the first stage (tokens)."""
        dy = self._check_cotangent(residuals, dy)
        out = self._bi(*self._bi_args(residuals, dy))
        if self.remat == "full":
            return out
        dx, cots, parts = out
        return dx, WeightResiduals(rs.resolve_records(residuals.records, residuals.vjp), cots, parts,
                                   residuals.site_index)

    def backward_weight(self, params, weight_residuals, acc=None):
        """2BP backward-p2: the parameter gradients (the stage's param dict structure). Several
        microbatches give the sum of their gradients, either as one batch concatenated with
        ``concat_weight_residuals`` (one larger matmul per site, 2BP Fig. 2) or as a list or tuple of
        their ``WeightResiduals`` (one program, no copy: :meth:`_bw_sum_kernel`). ``acc``: a running
        gradient sum to add them to, inside the kernel; it is donated (do not use it afterwards)."""
        self._check_params(params)
        self._check_acc(acc, params)
        wrs = list(weight_residuals) if isinstance(weight_residuals, (list, tuple)) else [weight_residuals]
        bad = sorted({type(w).__name__ for w in wrs if not isinstance(w, WeightResiduals)})
        if bad or not wrs:
            raise ValueError(f"backward_weight needs WeightResiduals or a non-empty list of them, got "
                             f"{type(weight_residuals).__name__}{' of ' + ', '.join(bad) if bad else ''}")
        rs.check_one_layout(wrs)
        if len(wrs) == 1:
            return self._bw(params, wrs[0], acc)
        for i in range(0, len(wrs), SUM_CHUNK):  # bounded programs: compile time grows with K
            acc = self._bw_sum(params, tuple(wrs[i:i + SUM_CHUNK]), acc)
        return acc

    def backward(self, residuals: Residuals, dy, acc=None):
        """Fused backward (input and weight gradients in one jit): ``(dx, dparams)``, or ``(dx, acc +
        dparams)`` with a running gradient sum ``acc``, which is donated (do not use it afterwards)."""
        dy = self._check_cotangent(residuals, dy)
        self._check_acc(acc, residuals.params)
        return self._fused(residuals, dy, acc)

    def as_function(self):
        """``f(params, x, targets) -> y`` as a ``jax.custom_vjp`` whose backward is backward_input then
        backward_weight, so ``jax.grad`` through a chain of stages runs the pipeline's kernels."""
        if self._fn is None:
            @jax.custom_vjp
            def f(params, x, targets):
                return self.forward(params, x, targets)[0]

            def f_fwd(params, x, targets):
                return self.forward(params, x, targets)

            def f_bwd(res, dy):
                dx, wr = self.backward_input(res, dy)
                return self.backward_weight(res.params, wr), dx, None

            f.defvjp(f_fwd, f_bwd)
            self._fn = f
        return self._fn
