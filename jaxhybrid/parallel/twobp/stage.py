"""A pipeline stage: a contiguous slice of blocks with jitted forward / backward-p1 / backward-p2 kernels.

A :class:`Stage` owns blocks ``[first_block, last_block)``; the first stage also owns the embedding and
the last one the head and the loss. Its four kernels are pure, jitted once per input shape, and built on
the taps split of :mod:`jaxhybrid.parallel.twobp.backprop` (2BP Sec. 3):

* ``forward(params, x, targets=None) -> (y, residuals)``
* ``backward_input(residuals, dy) -> (dx, weight_residuals)``       (2BP backward-p1)
* ``backward_weight(params, weight_residuals) -> dparams``          (2BP backward-p2; also on several
  microbatches, concatenated with :func:`concat_weight_residuals` or as a list, returning the SUM of
  their gradients)
* ``backward(residuals, dy) -> (dx, dparams)``                       (fused, for schedules without 2BP)

``backward`` and ``backward_weight`` take an optional running gradient sum ``acc`` (donated) and return
``acc + dparams``: a pipeline sums over microbatches inside the kernels instead of in an add program each.

Tied embeddings: a last stage that is not also the first gets the token table as its own parameter
``TIED_KEY = "embed_wte_copy"`` (Megatron's copy); :func:`assemble_grads` adds its gradient to
``embed.wte``.

A stage is built from its parts: its :class:`~jaxhybrid.parallel.twobp.layout.StageLayout` (blocks,
segments, parameter names), the input checks (:mod:`~jaxhybrid.parallel.twobp.stage_checks`), the traced
passes (:mod:`~jaxhybrid.parallel.twobp.stage_passes`) and the jitted kernels that run them
(:mod:`~jaxhybrid.parallel.twobp.stage_kernels`). Each public kernel call checks its inputs, then runs
the kernel.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.model.transformer import TIED_KEY, Model, block_name
from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.layout import StageLayout
from jaxhybrid.parallel.twobp.residuals import Residuals, WeightResiduals
from jaxhybrid.parallel.twobp.stage_checks import StageChecks
from jaxhybrid.parallel.twobp.stage_kernels import StageKernels
from jaxhybrid.parallel.twobp.weight_join import auto_weight_join, concat_weight_residuals, weight_join


class Stage:
    """Blocks ``[first_block, last_block)`` of ``model`` (see module docstring).

    Args:
      model: the whole model (its ops object and compute dtype are used as they are).
      first_block, last_block: the block range; ``0 <= first < last <= n_layers``.
      num_stages_hint: pipeline depth G_inter, used to pick Myelin's checkpoint interval when
        ``remat="full"`` and ``checkpoint_interval == 0``.
      remat: what the forward keeps for the input pass: ``none`` (all activations), ``dots`` (matmul
        outputs without batch dims; the rest is recomputed in backward_input) or ``full`` (only the inputs
        of segments of ``ac`` blocks; backward_input recomputes each segment).
      checkpoint_interval: Myelin's ac (blocks per segment, Sec. V-A), only with ``remat="full"``;
        0 = ``optimal_checkpoint_interval(n_layers, num_stages_hint)`` or 1 (every block) without a hint.

    Parts: ``layout`` (:class:`StageLayout`), ``checks`` (:class:`StageChecks`), ``passes``
    (:class:`StagePasses`, whose ``trace_counts`` the stage shows) and ``kernels`` (:class:`StageKernels`).
    """

    def __init__(self, model: Model, first_block: int, last_block: int, *, num_stages_hint: int | None = None,
                 remat: str = "none", checkpoint_interval: int = 0):
        self.layout = lay = StageLayout.build(model, first_block, last_block, num_stages_hint=num_stages_hint,
                                              remat=remat, checkpoint_interval=checkpoint_interval)
        self.model, self.cfg = lay.model, lay.cfg
        self.first_block, self.last_block = lay.first_block, lay.last_block
        self.is_first, self.is_last = lay.is_first, lay.is_last
        self.remat, self.num_blocks = lay.remat, lay.last_block - lay.first_block
        self.checkpoint_interval, self.segments = lay.checkpoint_interval, lay.segments
        self.param_names: list[str] = lay.param_names
        self.checks = StageChecks(lay)
        self.kernels = StageKernels.of(lay)  # shared with every stage of an equal layout in this process
        self.passes = self.kernels.passes
        self._fn = None  # as_function's custom_vjp, built once

    def __repr__(self) -> str:
        return repr(self.layout)

    @property
    def trace_counts(self) -> dict[str, int]:
        """Traces of each kernel so far, by every stage of an equal layout in this process (one per compiled
        input shape; see :class:`StagePasses`)."""
        return self.passes.trace_counts

    # ---- kernels ----------------------------------------------------------------------------------------
    def forward(self, params, x, targets=None):
        """Run the stage on one microbatch. First stage: ``x`` int32 tokens ``[mb, T]``; others:
        activations ``[mb, T, d]`` in the compute dtype. Last stage: returns the mean loss (float32 scalar)
        over the microbatch and needs ``targets`` int32 ``[mb, T]``. Returns ``(y, residuals)``."""
        x, targets = self.checks.inputs(params, x, targets)
        return self.kernels.forward(params, x, targets)

    def evaluate(self, params, x, targets=None):
        """Forward only, keeping no residuals (validation): inputs and output as in :meth:`forward`."""
        x, targets = self.checks.inputs(params, x, targets)
        return self.kernels.eval_program(params, x, targets)

    def backward_input(self, residuals: Residuals, dy):
        """2BP backward-p1: ``(dx, weight_residuals)``; ``dx`` is None on the first stage (tokens)."""
        dy = self.checks.cotangent(residuals, dy)
        return self.kernels.backward_input(residuals, dy)

    def backward_weight(self, params, weight_residuals, acc=None):
        """2BP backward-p2: the parameter gradients (the stage's param dict structure). Several
        microbatches give the sum of their gradients, either as one batch concatenated with
        ``concat_weight_residuals`` (one larger matmul per site, 2BP Fig. 2) or as a list or tuple of
        their ``WeightResiduals`` (one program, no copy: :meth:`StagePasses.weight_sum`). ``acc``: a
        running gradient sum to add them to, inside the kernel; it is donated (do not use it afterwards)."""
        self.checks.params(params)
        self.checks.acc(acc, params)
        return self.kernels.backward_weight(params, self.checks.weight_residuals(weight_residuals), acc)

    def backward(self, residuals: Residuals, dy, acc=None):
        """Fused backward (input and weight gradients in one jit): ``(dx, dparams)``, or ``(dx, acc +
        dparams)`` with a running gradient sum ``acc``, which is donated (do not use it afterwards)."""
        dy = self.checks.cotangent(residuals, dy)
        self.checks.acc(acc, residuals.params)
        return self.kernels.fused_program(residuals, dy, acc)

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

    # ---- parameters -------------------------------------------------------------------------------------
    def slice_params(self, full_params: dict) -> dict:
        """This stage's parameters from the model's full flat dict (the tied table is shared, not copied)."""
        return self.layout.slice_params(full_params)

    def init_params(self, rng: jax.Array, shardings_of: Any = None) -> dict:
        """The stage's slice of ``model.init(rng)``, jitted as every engine's init is (bit-identical to
        slicing the whole model's jitted init, test_stage), materialising only the stage's own parts: a
        pipeline rank never holds the whole model. ``shardings_of`` (abstract slice -> shardings, e.g. the
        rank's tensor mesh's ``param_shardings``) makes each device compute only its own shards."""
        out = None if shardings_of is None else shardings_of(self.kernels.abstract_params)
        return self.kernels.init(rng, out)

    @functools.cached_property
    def param_bytes(self) -> int:
        """Bytes of the stage's parameters (float32 masters), and so of one tree of its gradients; from
        shapes only, nothing materialised."""
        return rs.tree_bytes(self.kernels.abstract_params)

    @property
    def init_parts(self) -> tuple[str, ...]:
        """The model parts ``Model.init`` must materialise for this stage (the tied copy comes with head)."""
        return self.layout.init_parts

    def wte(self, params: dict):
        """The token table the head ties to; None untied (:meth:`StageLayout.wte`)."""
        return self.layout.wte(params)

    # ---- residual bookkeeping -----------------------------------------------------------------------------
    @staticmethod
    def residual_bytes(residuals: Residuals) -> int:
        """Bytes the residuals keep alive between forward and backward_input (the stage's live parameters,
        referenced so the input pass can use them, are not counted: they are not per-microbatch copies)."""
        return rs.tree_bytes((residuals.vjp, residuals.records, residuals.seg_inputs, residuals.targets))

    @staticmethod
    def weight_residual_bytes(wr: WeightResiduals) -> int:
        """Bytes kept between backward_input and backward_weight (site inputs, their output cotangents and
        the per-sample gradients of norm weights and biases)."""
        return rs.tree_bytes(wr)

    def _abstract(self, mb: int, seq: int):
        p = self.slice_params(self.model.abstract_params(min(seq, self.cfg.max_seq_len)))
        x = (jax.ShapeDtypeStruct((mb, seq), jnp.int32) if self.is_first
             else jax.ShapeDtypeStruct((mb, seq, self.cfg.d_model), self.model.dtype))
        t = jax.ShapeDtypeStruct((mb, seq), jnp.int32) if self.is_last else None
        return p, x, t

    def activation_bytes(self, mb: int, seq: int) -> int:
        """Static estimate (no compute) of :meth:`residual_bytes` for one microbatch of ``mb x seq``."""
        p, x, t = self._abstract(mb, seq)
        return self.residual_bytes(jax.eval_shape(lambda p, x, t: self.forward(p, x, t)[1], p, x, t))

    def weight_residual_bytes_estimate(self, mb: int, seq: int) -> int:
        """Static estimate (no compute) of :meth:`weight_residual_bytes` for one microbatch."""
        p, x, t = self._abstract(mb, seq)

        def chain(p, x, t):
            y, res = self.forward(p, x, t)
            return self.backward_input(res, jnp.ones_like(y))[1]

        return self.weight_residual_bytes(jax.eval_shape(chain, p, x, t))


def assemble_grads(stages: list[Stage], grads_list: list[dict]) -> dict:
    """Full-model gradients (the model's flat dict) from per-stage gradients; the tied head copy's
    gradient is added to ``embed.wte`` (Megatron's tied-embedding all-reduce, here a local sum)."""
    if len(stages) != len(grads_list):
        raise ValueError(f"{len(stages)} stages but {len(grads_list)} gradient dicts")
    full: dict[str, Any] = {}
    tied = []
    for s, g in zip(stages, grads_list):
        for k, v in g.items():
            if k == TIED_KEY:
                tied.append(v)
            elif k in full:
                raise ValueError(f"parameter {k!r} is owned by two stages; block ranges overlap")
            else:
                full[k] = v
    names = stages[0].model.names
    missing = [k for k in names if k not in full]
    if missing:
        raise ValueError(f"stages do not cover the model: no gradients for {missing}")
    if tied:
        full["embed"] = dict(full["embed"], wte=full["embed"]["wte"] + sum(tied[1:], tied[0]))
    return {k: full[k] for k in names}


def make_stages(model: Model, partition: list[int], **kw) -> list[Stage]:
    """Stages from blocks-per-stage counts (``parallel.partition``), e.g. ``[3, 3, 2]`` for 8 blocks."""
    if sum(partition) != model.cfg.n_layers or any(b < 1 for b in partition):
        raise ValueError(f"partition {list(partition)} must be positive and sum to n_layers={model.cfg.n_layers}")
    bounds = [0]
    for b in partition:
        bounds.append(bounds[-1] + b)
    return [Stage(model, lo, hi, num_stages_hint=len(partition), **kw) for lo, hi in zip(bounds, bounds[1:])]


def reference_apply(stage: Stage, params: dict, x, targets=None):
    """The stage's slice through the model's own ``apply_*`` functions (no taps, no kernels): the
    reference that tests and ``bench stage`` differentiate with plain ``jax.vjp``."""
    m = stage.model
    h = m.apply_embed(params["embed"], x) if stage.is_first else x
    for i in range(stage.first_block, stage.last_block):
        h = m.apply_block(params[block_name(i)], h)
    return m.apply_head(params["head"], h, targets, stage.wte(params)) if stage.is_last else h


def model_loss_via_stages(stages: list[Stage], params_list: list[dict], tokens, targets) -> jax.Array:
    """The whole model's loss as a chain of the stages' ``custom_vjp`` functions: ``jax.grad`` of this
    runs exactly the kernels the pipeline calls (forward, backward_input, backward_weight)."""
    if len(stages) != len(params_list):
        raise ValueError(f"{len(stages)} stages but {len(params_list)} parameter dicts")
    h = tokens
    for s, p in zip(stages, params_list):
        h = s.as_function()(p, h, targets if s.is_last else None)
    return h


__all__ = ["Stage", "Residuals", "WeightResiduals", "TIED_KEY", "assemble_grads", "concat_weight_residuals",
           "weight_join", "auto_weight_join", "make_stages", "model_loss_via_stages", "reference_apply"]
