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
``embed.wte``. Kernel construction and the whole-model ``custom_vjp`` live in ``stage_kernels.py``, what the
kernels compute in ``stage_passes.py``.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.core.config.model import REMATS
from jaxhybrid.model.remat import optimal_checkpoint_interval
from jaxhybrid.model.transformer import TIED_KEY, Model, block_name
from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.residuals import Residuals, WeightResiduals
from jaxhybrid.parallel.twobp.stage_kernels import StageKernels
from jaxhybrid.parallel.twobp.weight_join import auto_weight_join, concat_weight_residuals, weight_join


class Stage(StageKernels):
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
    """

    def __init__(self, model: Model, first_block: int, last_block: int, *, num_stages_hint: int | None = None,
                 remat: str = "none", checkpoint_interval: int = 0):
        n = model.cfg.n_layers
        if not (isinstance(first_block, int) and isinstance(last_block, int)) or not 0 <= first_block < last_block <= n:
            raise ValueError(f"stage block range [{first_block}, {last_block}) is empty or outside the model's "
                             f"{n} blocks; need 0 <= first_block < last_block <= {n}")
        if remat not in REMATS:
            raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMATS)}")
        if checkpoint_interval < 0 or (checkpoint_interval > 0 and remat != "full"):
            raise ValueError(f"checkpoint_interval={checkpoint_interval} with remat={remat!r}: the interval must be "
                             f">= 0 and is only used with remat='full'")
        if num_stages_hint is not None and not 1 <= num_stages_hint <= n:
            raise ValueError(f"num_stages_hint={num_stages_hint} must be in [1, n_layers={n}]")
        self.model = model
        self.cfg = model.cfg
        self.first_block, self.last_block = first_block, last_block
        self.is_first, self.is_last = first_block == 0, last_block == n
        self.remat = remat
        self.num_blocks = last_block - first_block
        if remat == "full":
            ac = checkpoint_interval or (optimal_checkpoint_interval(n, num_stages_hint) if num_stages_hint else 1)
            self.checkpoint_interval = min(ac, self.num_blocks)
            self.segments = [(lo, min(lo + ac, last_block)) for lo in range(first_block, last_block, ac)]
        else:
            self.checkpoint_interval = 0
            self.segments = [(first_block, last_block)]
        names = (["embed"] if self.is_first else []) + [block_name(i) for i in range(first_block, last_block)]
        names += ["head"] if self.is_last else []
        if self.is_last and self.cfg.tie_embeddings and not self.is_first:
            names.append(TIED_KEY)
        self.param_names: list[str] = names
        super().__init__()

    def __repr__(self) -> str:
        return (f"Stage(blocks=[{self.first_block}, {self.last_block}), first={self.is_first}, last={self.is_last}, "
                f"remat={self.remat!r}, ac={self.checkpoint_interval}, dtype={self.model.compute_dtype})")

    # ---- parameters -------------------------------------------------------------------------------------
    def slice_params(self, full_params: dict) -> dict:
        """This stage's parameters from the model's full flat dict (the tied table is shared, not copied)."""
        missing = [k for k in self.param_names if k != TIED_KEY and k not in full_params]
        if missing:
            raise ValueError(f"full params lack {missing} needed by {self!r}")
        out = {k: full_params[k] for k in self.param_names if k != TIED_KEY}
        if TIED_KEY in self.param_names:
            out[TIED_KEY] = full_params["embed"]["wte"]
        return out

    def init_params(self, rng: jax.Array, shardings_of: Any = None) -> dict:
        """The stage's slice of ``model.init(rng)``, jitted as every engine's init is (bit-identical to
        slicing the whole model's jitted init, test_stage), materialising only the stage's own parts: a
        pipeline rank never holds the whole model. ``shardings_of`` (abstract slice -> shardings, e.g. the
        rank's tensor mesh's ``param_shardings``) makes each device compute only its own shards."""
        out = None if shardings_of is None else shardings_of(jax.eval_shape(self._init_slice, rng))
        return jax.jit(self._init_slice, out_shardings=out)(rng)

    def _init_slice(self, rng: jax.Array) -> dict:
        """The stage's params from ``Model.init``, initialising only the stage's own parts."""
        return self.slice_params(self.model.init(rng, None, self.init_parts))

    @functools.cached_property
    def param_bytes(self) -> int:
        """Bytes of the stage's parameters (float32 masters), and so of one tree of its gradients; from
        shapes only, nothing materialised."""
        return rs.tree_bytes(jax.eval_shape(self._init_slice, jax.random.key(0)))

    @property
    def init_parts(self) -> tuple[str, ...]:
        """The model parts ``Model.init`` must materialise for this stage (the tied copy comes with head)."""
        return tuple(k for k in self.param_names if k != TIED_KEY)

    def wte(self, params: dict):
        if not self.cfg.tie_embeddings:
            return None
        return params["embed"]["wte"] if self.is_first else params[TIED_KEY]

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
