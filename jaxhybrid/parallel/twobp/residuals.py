"""What the 2BP stage kernels keep between passes, and how it is counted and batched.

* :class:`ParamSlot`, :func:`strip_params`, :func:`fill_params`: the forward's vjp residuals hold the
  stage's parameters; they are replaced by slots so residuals never store per-microbatch weight copies,
  and the live parameters are put back by the input pass.
* :func:`remat_save_policy`: what the forward keeps for the input pass (remat none / dots).
* :func:`tree_bytes`: the residual bytes the simulator, the planner and the memory reports use.
* :func:`concat_batch`: weight residuals of K microbatches as one batch (2BP Fig. 2).
* :class:`Residuals` (forward -> input pass) and :class:`WeightResiduals` (input pass -> weight pass).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.model.layers import NORM_STATS
from jaxhybrid.parallel.twobp.backprop import SITE_OUTPUT


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Placeholder for a stage parameter inside stored residuals (no data: the live params are re-inserted
    by the input pass, so residuals never hold per-microbatch copies of the weights)."""

    index: int


jax.tree_util.register_dataclass(ParamSlot, data_fields=[], meta_fields=["index"])


def strip_params(tree: Any, params: Any) -> Any:
    """Replace leaves of ``tree`` that ARE (by identity, at trace time) leaves of ``params`` with slots."""
    ids = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [ParamSlot(ids[id(v)]) if id(v) in ids else v for v in leaves])


def fill_params(tree: Any, params: Any) -> Any:
    """Inverse of :func:`strip_params`: put the live parameter arrays back into the slots."""
    leaves = jax.tree.leaves(params)
    return jax.tree.map(lambda v: leaves[v.index] if isinstance(v, ParamSlot) else v, tree,
                        is_leaf=lambda v: isinstance(v, ParamSlot))


@dataclasses.dataclass(frozen=True)
class VjpRef:
    """Placeholder for a record (site input) that is also a residual of the forward's vjp: leaf ``index``
    of the stripped vjp. Why: a jit output made twice is stored twice; under the tensor-parallel ops every
    site input is a vjp residual too (``Linear3D`` keeps X for dW), so each was kept twice per microbatch."""

    index: int


jax.tree_util.register_dataclass(VjpRef, data_fields=[], meta_fields=["index"])


def share_records(records: list, vjp: Any) -> list:
    """Records that ARE (by identity, at trace time) leaves of ``vjp`` become :class:`VjpRef`."""
    ids = {id(v): i for i, v in enumerate(jax.tree.leaves(vjp))}
    return [VjpRef(ids[id(r)]) if id(r) in ids else r for r in records]


def resolve_records(records: list, vjp: Any) -> list:
    """Inverse of :func:`share_records` on the forward's outputs: the arrays themselves (no copy)."""
    if not any(isinstance(r, VjpRef) for r in records):  # reference ops: nothing shared, no flatten per call
        return records
    leaves = jax.tree.leaves(vjp)
    return [leaves[r.index] if isinstance(r, VjpRef) else r for r in records]


def remat_save_policy(remat: str, also_save: tuple[str, ...] = ()):
    """The jax.checkpoint policy that decides what the forward keeps for the input pass; None (remat
    "none"): no checkpoint, plain ``jax.vjp``, which keeps every intermediate the input pass reads.
    ``also_save``: the ops object's :attr:`~jaxhybrid.model.layers.Ops.saved_names` (a tensor-parallel
    stage's gathered weights: AxoNN optimization E, so the input pass does not gather them again).

    Why not a save-everything policy: plain ``jax.vjp`` keeps the same arrays, but XLA builds a leaner and
    faster forward of it (fewer bytes accessed). Casts of the float32 masters stay out of the residuals
    without one: the forward differentiates their cast copy (``Model.cast_matrices``)."""
    if remat == "none":
        return None
    if remat == "dots":
        # The tapped sites' outputs (their matmul plus bias and tap; backprop.SITE_OUTPUT) and the norms'
        # statistics. Why not ``dots_with_no_batch_dims_saveable``: it saves the bare matmul outputs, and
        # recomputing ``matmul + tap`` then keeps each site's tap, a zero array of the site output's size,
        # as a residual too (gpt-small-cpu block: 48.4 -> 32.3 bytes per token and model width in bf16).
        return jax.checkpoint_policies.save_only_these_names(SITE_OUTPUT, NORM_STATS, *also_save)
    raise ValueError(f"remat={remat!r} has no save policy (full uses segment recomputation)")


def tree_bytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` (arrays or ShapeDtypeStructs); slots count zero."""
    total = 0
    for v in jax.tree.leaves(tree):
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            total += int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
    return total


def pack_partials(parts: list) -> dict:
    """Per-sample weight gradients (``[mb, 1.., d]`` each, in per_sample order) as one ``[mb, sum d]``
    array per dtype. Why: a stage has dozens of these small vectors (8 per GPT-2 block); one buffer per
    dtype instead of one each saves an output of the input pass, an input of the weight pass and a
    reduction kernel in it, per vector (a jitted call pays a fixed host cost per buffer and kernel)."""
    groups: dict[str, list] = {}
    for g in parts:
        groups.setdefault(jnp.dtype(g.dtype).name, []).append(g.reshape(g.shape[0], -1))
    return {k: jnp.concatenate(v, axis=-1) for k, v in groups.items()}


def check_one_layout(wrs: list) -> None:
    """Weight residuals joined for one weight pass (concatenated or summed) must come from one stage
    layout: the same ``site_index``."""
    n = len({w.site_index for w in wrs})
    if n > 1:
        raise ValueError(f"weight residuals come from {n} different stages or layouts; join only one stage's")


def concat_batch(trees: list[Any]) -> Any:
    """Concatenate pytrees of identical structure leaf by leaf along axis 0 (the microbatch batch dim)."""
    if not trees:
        raise ValueError("concat of an empty list of weight residuals; pass at least one")
    first = jax.tree.structure(trees[0])
    for k, t in enumerate(trees[1:], 1):
        if jax.tree.structure(t) != first:
            raise ValueError(f"weight residuals {k} have another structure than 0 (different stage or "
                             f"sequence length?): {jax.tree.structure(t)} vs {first}")
    if len(trees) == 1:
        return trees[0]
    return _concat_jit(trees)


@jax.jit
def _concat_jit(trees):
    # One compiled copy per shape instead of one eager dispatch per leaf.
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trees)


@dataclasses.dataclass(frozen=True)
class Static:
    """A hashable Python value carried through ``jit`` outputs as pytree metadata."""

    value: Any


jax.tree_util.register_dataclass(Static, data_fields=[], meta_fields=["value"])


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What forward leaves for backward_input (one microbatch). ``params`` references the live stage
    parameters (not counted as residual memory); exactly one of ``vjp``+``records`` (saved mode) or
    ``seg_inputs``+``targets`` (segment mode) is set."""

    params: Any
    vjp: Any = None
    records: Any = None
    seg_inputs: Any = None
    targets: Any = None
    site_index: tuple = ()
    out_shape: tuple = ()
    out_dtype: str = ""


jax.tree_util.register_dataclass(Residuals, data_fields=["params", "vjp", "records", "seg_inputs", "targets"],
                                 meta_fields=["site_index", "out_shape", "out_dtype"])


@dataclasses.dataclass(frozen=True)
class WeightResiduals:
    """What backward_input leaves for backward_weight: the distinct site inputs (``records``), the site
    output cotangents (``cots``), the per-sample gradients of norm weights and biases (``partials``,
    packed one ``[mb, sum d]`` array per dtype name by :func:`pack_partials`)
    and, statically, which record each site reads. Every leaf has the microbatch as its leading dim, so
    several can be concatenated along it."""

    records: Any
    cots: Any
    partials: Any = dataclasses.field(default_factory=dict)
    site_index: tuple = ()

    @property
    def batch(self) -> int:
        return int(jax.tree.leaves(self.records)[0].shape[0])


jax.tree_util.register_dataclass(WeightResiduals, data_fields=["records", "cots", "partials"],
                                 meta_fields=["site_index"])
