"""The jitted kernels of a :class:`~jaxhybrid.parallel.twobp.stage.Stage`: the traced bodies of
:class:`~jaxhybrid.parallel.twobp.stage_passes.StagePasses` compiled once per input shape (each jit holds its
compile cache), and their outputs packed as the residual pytrees the next pass takes: the forward's
:class:`~jaxhybrid.parallel.twobp.residuals.Residuals`, 2BP backward-p1's
:class:`~jaxhybrid.parallel.twobp.residuals.WeightResiduals`, and backward-p2 over several microbatches in
bounded chunks (2BP Sec. 3.2, Fig. 2). The inputs are checked before, by the stage.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxhybrid.model import compiled_init
from jaxhybrid.model.transformer import TIED_KEY
from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.layout import StageLayout
from jaxhybrid.parallel.twobp.residuals import Residuals, WeightResiduals
from jaxhybrid.parallel.twobp.stage_passes import StagePasses

# Most microbatches per summed weight-pass program; more run as several programs, each adding the
# running sum. Why: its compile time grows with K (4-block gpt-small-cpu stage: 0.3 s at K=1, 1.3 s at 8,
# 2.1 s at 16), and a schedule's flush can hold all M microbatches.
SUM_CHUNK = 8
# Kernels of the layouts built last (StageKernels.of): stages of equal layouts (a rebuilt engine, a resume,
# tests that build a stage again) share one set of jits and so trace and compile once.
SHARED_LAYOUTS = 64
_shared: collections.OrderedDict = collections.OrderedDict()


class StageKernels:
    """The stage's programs: ``forward_program``, ``input_program`` (backward-p1), ``weight_program`` and
    ``weight_sum_program`` (backward-p2 of one batch, or the sum over K microbatches), ``fused_program``
    and ``eval_program``, each a ``jax.jit`` of a pass of ``passes``."""

    @classmethod
    def of(cls, layout: StageLayout) -> StageKernels:
        """The kernels of ``layout``, shared by every stage of an equal layout (:attr:`StageLayout.key`);
        the newest ``SHARED_LAYOUTS`` layouts are kept."""
        key = layout.key
        if key in _shared:
            _shared.move_to_end(key)
        else:
            _shared[key] = cls(StagePasses(layout))
            while len(_shared) > SHARED_LAYOUTS:
                _shared.popitem(last=False)
        return _shared[key]

    def __init__(self, passes: StagePasses):
        self.passes = passes
        self.full = passes.layout.remat == "full"  # segment inputs kept, else the saved vjp
        self.forward_program = jax.jit(passes.forward_segments if self.full else passes.forward_saved)
        self.input_program = jax.jit(passes.input_segments if self.full else passes.input_saved)
        # acc (a running gradient sum) is donated: the result reuses its buffers.
        self.weight_program = jax.jit(passes.weight, donate_argnames="acc")
        self.weight_sum_program = jax.jit(passes.weight_sum, donate_argnames="acc")
        self.fused_program = jax.jit(passes.fused, donate_argnames="acc")
        self.eval_program = jax.jit(passes.evaluate)

    @functools.cached_property
    def abstract_params(self):
        """The shapes and dtypes of the stage's params (:meth:`StagePasses.init` traced once, nothing
        materialised)."""
        return jax.eval_shape(self.passes.init, jax.random.key(0))

    def init(self, rng, out_shardings=None):
        """The stage's initial params (the values of :meth:`StagePasses.init`, computed part by part by
        ``compiled_init``), placed by ``out_shardings`` (a pytree of shardings, or None: the default device)."""
        lay = self.passes.layout
        parts = None
        if out_shardings is not None:  # by model part: the tied copy is the table of the embed its head brings
            parts = {k: v for k, v in out_shardings.items() if k != TIED_KEY}
            if TIED_KEY in out_shardings and "embed" not in parts:
                embed = jax.eval_shape(lambda k: lay.model.init(k, None, ("embed",)), rng)["embed"]
                parts["embed"] = {k: out_shardings[TIED_KEY] if k == "wte" else None for k in embed}
        return lay.slice_params(compiled_init(lay.model, rng, lay.init_parts, parts))

    def forward(self, params, x, targets):
        """``(y, Residuals)``, the residuals in this stage's layout with the output's shape and dtype."""
        if self.full:
            y, keep = self.forward_program(params, x, targets)
            res = Residuals(params, seg_inputs=[x] + list(keep), targets=targets)
        else:
            y, vjp, records, idx = self.forward_program(params, x, targets)
            res = Residuals(params, vjp=vjp, records=records, site_index=idx.value)
        return y, dataclasses.replace(res, out_shape=tuple(y.shape), out_dtype=str(jnp.dtype(y.dtype)))

    def input_args(self, residuals: Residuals, dy) -> tuple:
        """``input_program``'s arguments for either residual layout (segment inputs or saved vjp)."""
        if self.full:
            return residuals.params, residuals.seg_inputs, residuals.targets, dy
        return residuals.params, residuals.vjp, dy

    def backward_input(self, residuals: Residuals, dy):
        """2BP backward-p1: ``(dx, WeightResiduals)``."""
        out = self.input_program(*self.input_args(residuals, dy))
        if self.full:
            return out
        dx, cots, parts = out
        return dx, WeightResiduals(rs.resolve_records(residuals.records, residuals.vjp), cots, parts,
                                   residuals.site_index)

    def backward_weight(self, params, wrs: list[WeightResiduals], acc):
        """2BP backward-p2 of one batch, or the sum over several microbatches' residuals in programs of
        at most ``SUM_CHUNK`` (each adding the running sum), plus ``acc``."""
        if len(wrs) == 1:
            return self.weight_program(params, wrs[0], acc)
        for i in range(0, len(wrs), SUM_CHUNK):  # bounded programs: compile time grows with K
            acc = self.weight_sum_program(params, tuple(wrs[i:i + SUM_CHUNK]), acc)
        return acc
