"""The traced bodies of a :class:`~jaxhybrid.parallel.twobp.stage.Stage`'s kernels (jitted by
:class:`~jaxhybrid.parallel.twobp.stage_kernels.StageKernels`) and their residual pytrees: the forward,
2BP's backward-p1 (input gradients, :meth:`StagePasses.input_saved` / :meth:`StagePasses.input_segments`)
and backward-p2 (weight gradients, :meth:`StagePasses.weight`, several microbatches as in 2BP Fig. 2), and
the fused backward.

Two ways of keeping what backward-p1 needs (chosen by ``remat``):

* "saved" (remat none / dots): the forward takes ``jax.vjp`` of the tapped stage (remat dots: under a
  ``jax.checkpoint`` save policy) and returns the vjp's residuals, with the stage's parameters (in the
  compute dtype) replaced by :class:`~jaxhybrid.parallel.twobp.residuals.ParamSlot` placeholders, plus the site
  inputs (records) that backward-p2 will need (those the vjp keeps anyway as references to its arrays).
* "segments" (remat full, Myelin's interval ac): the forward keeps only the inputs of each segment of ac
  blocks; backward-p1 recomputes one segment at a time (in reverse) and emits the records there.

Either way backward-p1 returns the tap cotangents, and backward-p2 is one params-only gradient of the
replayed sites (see :mod:`jaxhybrid.parallel.twobp.backprop`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxhybrid.model.transformer import block_name
from jaxhybrid.parallel.twobp import backprop as bp
from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.layout import StageLayout
from jaxhybrid.parallel.twobp.residuals import Residuals, Static, WeightResiduals


def _plus(acc, grads):
    """``acc + grads`` inside a kernel (``acc`` None: grads). Why: a pipeline sums a stage's gradients
    over microbatches, and a separate add program per microbatch costs more than the add inside the
    kernel on a one-core pipeline rank."""
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


class StagePasses:
    """What each kernel computes, as traced functions of the arrays of one stage's ``layout``.
    ``trace_counts`` counts the traces of each pass (a jitted pass traces once per input shape; the fused
    backward traces the input pass's body too, and counts it)."""

    def __init__(self, layout: StageLayout):
        self.layout = layout
        self.trace_counts = {"forward": 0, "backward_input": 0, "backward_weight": 0, "backward_weight_sum": 0,
                             "backward": 0}

    # ---- the stage as a function of (params, x) through a given ops tape --------------------------------
    def run(self, tape, params, x, targets, lo, hi, embed: bool, head: bool):
        """Blocks ``[lo, hi)`` (with the embedding and the head where asked) with every op through ``tape``."""
        m = dataclasses.replace(self.layout.model, ops=bp.TapOps(self.layout.model.ops, tape))
        h = tape.site(lambda t: m.apply_embed(params["embed"], t), x) if embed else x
        for i in range(lo, hi):
            h = m.apply_block(params[block_name(i)], h)
        return m.apply_head(params["head"], h, targets, self.layout.wte(params)) if head else h

    def init(self, rng):
        """The stage's params from ``Model.init``, initialising only the stage's own parts."""
        lay = self.layout
        return lay.slice_params(lay.model.init(rng, None, lay.init_parts))

    def evaluate(self, params, x, targets):
        """Forward only (validation): the plain tape keeps nothing for a backward."""
        lay = self.layout
        return self.run(bp.Tape("plain"), params, x, targets, lay.first_block, lay.last_block, lay.is_first,
                        lay.is_last)

    def _segment(self, s: int, mode: str, params, x, targets, taps=None, wtaps=None):
        lay = self.layout
        lo, hi = lay.segments[s]
        tape = bp.Tape(mode, taps=taps, wtaps=wtaps)
        y = self.run(tape, params, x, targets, lo, hi, lay.is_first and s == 0,
                     lay.is_last and s == len(lay.segments) - 1)
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
        tokens_in = self.layout.is_first and s == 0

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
        model = self.layout.model
        if bp.TapOps(model.ops).reference:
            dt = jnp.dtype(model.dtype)
            cots = [c.astype(dt) if jnp.dtype(c.dtype).itemsize > dt.itemsize else c for c in cots]
        return dx, cots, [p.reshape(p.shape[0], *p.shape[p.ndim - 1:]) for p in parts]

    # ---- saved mode (remat none / dots) ------------------------------------------------------------------
    def forward_saved(self, params, x, targets):
        """The forward keeping the tapped vjp's residuals (params as slots) and backward-p2's records."""
        # The vjp of the cast copy (Model.cast_matrices): its casts are inputs, so they become slots.
        self.trace_counts["forward"] += 1
        model = self.layout.model
        pc = model.cast_matrices(params)
        policy = rs.remat_save_policy(self.layout.remat, model.ops.saved_names)
        y, vjp, records, index = self._tapped_vjp(0, pc, x, targets, policy)
        vjp = rs.strip_params(vjp, pc)
        return y, vjp, rs.share_records(records, vjp), Static(index)

    def input_saved(self, params, vjp, dy):
        """2BP backward-p1 from the saved vjp: ``(dx, tap cotangents, packed per-sample partials)``."""
        self.trace_counts["backward_input"] += 1
        vjp = rs.fill_params(vjp, self.layout.model.cast_matrices(params))
        dx, cots, parts = self._split_cts(vjp(dy), self.layout.is_first)
        return dx, cots, rs.pack_partials(parts)

    # ---- segment mode (remat full, checkpoint interval ac) -----------------------------------------------
    def forward_segments(self, params, x, targets):
        """The forward keeping only each later segment's input (Myelin V-A)."""
        self.trace_counts["forward"] += 1
        keep, h = [], x
        for s in range(len(self.layout.segments)):
            if s:
                keep.append(h)
            h, _ = self._segment(s, "plain", params, h, targets)
        return h, keep

    def input_segments(self, params, seg_inputs, targets, dy):
        """2BP backward-p1 recomputing one segment at a time, last first: ``(dx, WeightResiduals)``."""
        self.trace_counts["backward_input"] += 1
        recs, cots, parts, index, g = [], [], [], [], dy
        for s in reversed(range(len(self.layout.segments))):
            _, vjp, r, idx = self._tapped_vjp(s, params, seg_inputs[s], targets)
            g, c, w = self._split_cts(vjp(g), self.layout.is_first and s == 0)
            recs.insert(0, r), cots.insert(0, c), parts.insert(0, w), index.insert(0, idx)
        offsets = [sum(len(r) for r in recs[:k]) for k in range(len(recs))]
        flat_index = tuple(o + i for o, idx in zip(offsets, index) for i in idx)
        flat = lambda lists: [x for li in lists for x in li]  # noqa: E731
        return g, WeightResiduals(flat(recs), flat(cots), rs.pack_partials(flat(parts)), flat_index)

    # ---- backward-p2 and fused --------------------------------------------------------------------------
    def weight(self, params, wr: WeightResiduals, acc=None):
        """2BP backward-p2 of one microbatch (or one concatenated batch, Fig. 2), plus ``acc``."""
        self.trace_counts["backward_weight"] += 1
        return _plus(acc, self._weight_grads(params, wr))

    def weight_sum(self, params, wrs: tuple[WeightResiduals, ...], acc=None):
        """backward-p2 of K microbatches in one program: the sum of their K weight passes (plus ``acc``,
        the sum of earlier chunks), each reading its own residuals where they lie. Why not only the
        concatenation of 2BP Fig. 2 (one larger matmul per site): it first copies every record and
        cotangent of the K microbatches, which on a CPU can cost more than the weight pass itself."""
        self.trace_counts["backward_weight_sum"] += 1
        grads = [self._weight_grads(params, wr) for wr in wrs]
        return _plus(acc, jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *grads))

    def _weight_grads(self, params, wr: WeightResiduals, cots_in_program: bool = False):
        lay = self.layout

        def replay(p):
            tape = bp.Tape("replay", records=wr.records, site_index=wr.site_index, cots=wr.cots,
                           partials=wr.partials, cots_in_program=cots_in_program)
            first = wr.records[0]
            x = first if lay.is_first else jnp.zeros((*first.shape[:2], lay.cfg.d_model), lay.model.dtype)
            tgt = jnp.zeros(first.shape[:2], jnp.int32) if lay.is_last else None
            self.run(tape, p, x, tgt, lay.first_block, lay.last_block, lay.is_first, lay.is_last)
            widths = {k: v.shape[-1] for k, v in wr.partials.items()}
            if (tape.i, tape.offsets) != (len(wr.cots), widths):
                raise ValueError(f"weight pass replayed {tape.i} sites and per-token weight vectors of "
                                 f"{tape.offsets} elements but has {len(wr.cots)} cotangents and partials {widths}")
            return tape.acc

        return jax.grad(replay)(params)

    def fused(self, res: Residuals, dy, acc=None):
        """backward-p1 then backward-p2 in one program (schedules without 2BP): ``(dx, acc + dparams)``."""
        self.trace_counts["backward"] += 1
        if self.layout.remat == "full":
            dx, wr = self.input_segments(res.params, res.seg_inputs, res.targets, dy)
        else:
            dx, cots, parts = self.input_saved(res.params, res.vjp, dy)
            wr = WeightResiduals(rs.resolve_records(res.records, res.vjp), cots, parts, res.site_index)
        return dx, _plus(acc, self._weight_grads(res.params, wr, cots_in_program=True))
