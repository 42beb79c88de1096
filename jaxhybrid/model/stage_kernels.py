"""The jitted kernels of a :class:`~jaxhybrid.model.stage.Stage` and their residual pytrees.

Two ways of keeping what backward-p1 needs (chosen by ``remat``):

* "saved" (remat none / dots): the forward takes ``jax.vjp`` of the tapped stage (remat dots: under a
  ``jax.checkpoint`` save policy) and returns the vjp's residuals, with the stage's parameters (in the
  compute dtype) replaced by :class:`~jaxhybrid.model.residuals.ParamSlot` placeholders, plus the site
  inputs (records) that backward-p2 will need.
* "segments" (remat full, Myelin's interval ac): the forward keeps only the inputs of each segment of ac
  blocks; backward-p1 recomputes one segment at a time (in reverse) and emits the records there.

Either way backward-p1 returns the tap cotangents, and backward-p2 is one params-only gradient of the
replayed sites (see :mod:`jaxhybrid.model.backprop`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxhybrid.model import backprop as bp
from jaxhybrid.model import residuals as rs
from jaxhybrid.model.residuals import Residuals, Static, WeightResiduals
from jaxhybrid.model.stage_checks import StageChecks
from jaxhybrid.model.transformer import block_name


# Most microbatches per summed weight-pass program; more run as several programs, each adding the
# running sum. Why: its compile time grows with K (4-block gpt-small-cpu stage: 0.3 s at K=1, 1.3 s at 8,
# 2.1 s at 16), and a schedule's flush can hold all M microbatches.
SUM_CHUNK = 8


def _plus(acc, grads):
    """``acc + grads`` inside a kernel (``acc`` None: grads). Why: a pipeline sums a stage's gradients
    over microbatches, and a separate add program per microbatch cost more than the add inside the kernel
    (4-block gpt-small-cpu stage, 48 leaves, 3.2 MB, on one core as a pipeline rank runs: fused backward
    16.4-16.9 -> 16.0-16.5 ms, weight pass 6.5-6.8 -> 6.2 ms; about even on two cores)."""
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


class StageKernels(StageChecks):
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

    # ---- the stage as a function of (params, x) through a given ops tape --------------------------------
    def _run(self, tape, params, x, targets, lo, hi, embed: bool, head: bool):
        m = dataclasses.replace(self.model, ops=bp.TapOps(self.model.ops, tape))
        h = tape.site(lambda t: m.apply_embed(params["embed"], t), x) if embed else x
        for i in range(lo, hi):
            h = m.apply_block(params[block_name(i)], h)
        return m.apply_head(params["head"], h, targets, self.wte(params)) if head else h

    def _segment(self, s: int, mode: str, params, x, targets, taps=None, wtaps=None):
        lo, hi = self.segments[s]
        tape = bp.Tape(mode, taps=taps, wtaps=wtaps)
        y = self._run(tape, params, x, targets, lo, hi, self.is_first and s == 0,
                      self.is_last and s == len(self.segments) - 1)
        return y, tape

    def _tapped_vjp(self, s: int, params, x, targets, policy=None):
        """``jax.vjp`` of segment ``s`` w.r.t. (x, site taps, per-sample weight taps) (no x for tokens);
        returns (y, vjp, records, site_index)."""
        found = []
        jax.eval_shape(lambda p, x, t: found.append(self._segment(s, "discover", p, x, t)[1]) and 0,
                       params, x, targets)
        taps = [jnp.zeros(sh.shape, sh.dtype) for sh in found[0].shapes]
        wtaps = [jnp.zeros(sh.shape, sh.dtype) for sh in found[0].wshapes]
        index: list[int] = []
        tokens_in = self.is_first and s == 0

        def f(*diff):
            xx, tp, wtp = (x, *diff) if tokens_in else diff
            y, tape = self._segment(s, "tap", params, xx, targets, tp, wtp)
            index.extend(tape.site_index)
            return y, tape.records

        if policy is not None:
            f = jax.checkpoint(f, policy=policy)
        primals = (taps, wtaps) if tokens_in else (x, taps, wtaps)
        y, vjp, records = jax.vjp(f, *primals, has_aux=True)
        return y, vjp, records, tuple(index)

    def _split_cts(self, cts, tokens_in: bool):
        """The vjp's cotangents as (dx, site cotangents, per-sample weight gradients ``[mb, d]``); dx None
        for tokens. The taps were ``[mb, 1, d]``; their size-1 token axis is dropped here because XLA:CPU
        otherwise adds a layout copy per output (its reductions emit ``[mb, 1, d]`` in another layout).

        A site cotangent wider than the compute dtype (the float32 loss's logits gradient) is stored in
        the compute dtype: under the reference ops the weight pass casts it so before its matmul
        (``Tape.linear``), so the gradients are the same bits, and the last stage keeps half the bytes of
        its largest weight residual (``[mb, T, V]``) per microbatch until its weight pass."""
        dx, cots, parts = (None, *cts) if tokens_in else cts
        if bp.TapOps(self.model.ops).reference:
            dt = jnp.dtype(self.model.dtype)
            cots = [c.astype(dt) if jnp.dtype(c.dtype).itemsize > dt.itemsize else c for c in cots]
        return dx, cots, [p.reshape(p.shape[0], *p.shape[p.ndim - 1:]) for p in parts]

    # ---- saved mode (remat none / dots) ------------------------------------------------------------------
    def _forward_saved(self, params, x, targets):
        # The vjp of the cast copy (Model.cast_matrices): its casts are inputs, so they become slots.
        self.trace_counts["forward"] += 1
        pc = self.model.cast_matrices(params)
        y, vjp, records, index = self._tapped_vjp(0, pc, x, targets, rs.remat_save_policy(self.remat))
        vjp = rs.strip_params(vjp, pc)
        return y, vjp, rs.share_records(records, vjp), Static(index)

    def _bi_saved(self, params, vjp, dy):
        self.trace_counts["backward_input"] += 1
        vjp = rs.fill_params(vjp, self.model.cast_matrices(params))
        dx, cots, parts = self._split_cts(vjp(dy), self.is_first)
        return dx, cots, rs.pack_partials(parts)

    # ---- segment mode (remat full, checkpoint interval ac) -----------------------------------------------
    def _forward_segments(self, params, x, targets):
        self.trace_counts["forward"] += 1
        keep, h = [], x
        for s in range(len(self.segments)):
            if s:
                keep.append(h)
            h, _ = self._segment(s, "plain", params, h, targets)
        return h, keep

    def _bi_segments(self, params, seg_inputs, targets, dy):
        self.trace_counts["backward_input"] += 1
        recs, cots, parts, index, g = [], [], [], [], dy
        for s in reversed(range(len(self.segments))):
            _, vjp, r, idx = self._tapped_vjp(s, params, seg_inputs[s], targets)
            g, c, w = self._split_cts(vjp(g), self.is_first and s == 0)
            recs.insert(0, r), cots.insert(0, c), parts.insert(0, w), index.insert(0, idx)
        offsets = [sum(len(r) for r in recs[:k]) for k in range(len(recs))]
        flat_index = tuple(o + i for o, idx in zip(offsets, index) for i in idx)
        flat = lambda lists: [x for li in lists for x in li]  # noqa: E731
        return g, WeightResiduals(flat(recs), flat(cots), rs.pack_partials(flat(parts)), flat_index)

    # ---- backward-p2 and fused --------------------------------------------------------------------------
    def _bw_kernel(self, params, wr: WeightResiduals, acc=None):
        self.trace_counts["backward_weight"] += 1
        return _plus(acc, self._weight_grads(params, wr))

    def _bw_sum_kernel(self, params, wrs: tuple[WeightResiduals, ...], acc=None):
        """backward-p2 of K microbatches in one program: the sum of their K weight passes (plus ``acc``,
        the sum of earlier chunks), each reading its own residuals where they lie. Why not only the
        concatenation of 2BP Fig. 2 (one larger matmul per site): it first copies every record and
        cotangent of the K microbatches, which on a 2-core CPU cost more than the weight pass itself
        (gpt-small-cpu, 4 blocks, 4 x 128 tokens, K=4: 2.9 ms per microbatch for this program against 5.6
        for copy + concatenated pass, 3.6 for K calls)."""
        self.trace_counts["backward_weight_sum"] += 1
        grads = [self._weight_grads(params, wr) for wr in wrs]
        return _plus(acc, jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *grads))

    def _weight_grads(self, params, wr: WeightResiduals, cots_in_program: bool = False):
        def replay(p):
            tape = bp.Tape("replay", records=wr.records, site_index=wr.site_index, cots=wr.cots,
                           partials=wr.partials, cots_in_program=cots_in_program)
            first = wr.records[0]
            x = first if self.is_first else jnp.zeros((*first.shape[:2], self.cfg.d_model), self.model.dtype)
            tgt = jnp.zeros(first.shape[:2], jnp.int32) if self.is_last else None
            self._run(tape, p, x, tgt, self.first_block, self.last_block, self.is_first, self.is_last)
            widths = {k: v.shape[-1] for k, v in wr.partials.items()}
            if (tape.i, tape.offsets) != (len(wr.cots), widths):
                raise ValueError(f"weight pass replayed {tape.i} sites and per-token weight vectors of "
                                 f"{tape.offsets} elements but has {len(wr.cots)} cotangents and partials {widths}")
            return tape.acc

        return jax.grad(replay)(params)

    def _fused_kernel(self, res: Residuals, dy, acc=None):
        self.trace_counts["backward"] += 1
        if self.remat == "full":
            dx, wr = self._bi_segments(res.params, res.seg_inputs, res.targets, dy)
        else:
            dx, cots, parts = self._bi_saved(res.params, res.vjp, dy)
            wr = WeightResiduals(rs.resolve_records(res.records, res.vjp), cots, parts, res.site_index)
        return dx, _plus(acc, self._weight_grads(res.params, wr, cots_in_program=True))

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
