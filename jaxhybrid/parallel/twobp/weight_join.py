"""How one weight pass (2BP backward-p2) receives the weight residuals of several microbatches.

Either as one batch, concatenated (2BP Fig. 2: one larger matmul per site), or as a list whose weight
passes ``Stage.backward_weight`` sums in one program; ``pipeline.weight_join`` picks, ``auto`` by the bytes
each moves. The functions take a :class:`jaxhybrid.parallel.twobp.stage.Stage` (its ``param_bytes``).
"""
from __future__ import annotations

from typing import Any, Callable

from jaxhybrid.parallel.twobp import residuals as rs
from jaxhybrid.parallel.twobp.residuals import WeightResiduals


def concat_weight_residuals(wrs: list[WeightResiduals]) -> WeightResiduals:
    """Weight residuals of K microbatches as one batch (2BP Fig. 2): backward_weight on the result
    returns the sum of the K microbatches' weight gradients."""
    rs.check_one_layout(wrs)
    return rs.concat_batch(wrs)  # site_index is pytree metadata: equal across wrs, checked above


def weight_join(mode: str) -> Callable[[Any, list[WeightResiduals]], Any]:
    """How one weight pass receives several microbatches' weight residuals (``pipeline.weight_join``):
    ``join(stage, parts)`` gives ``Stage.backward_weight`` the list (``sum``: their weight passes summed
    in one program) or one batch (``concat``: :func:`concat_weight_residuals`, 2BP Fig. 2).

    ``auto`` (:func:`auto_weight_join`) weighs what each moves. Summing K weight passes writes K gradient
    trees of ``G`` bytes (:attr:`Stage.param_bytes`); concatenating reads and writes the K microbatches'
    weight residuals (``R`` bytes each) once, then writes one tree. It takes ``concat`` when that moves
    fewer bytes, ``2 K R + G < K G``, and the copy is no larger than one gradient tree, ``K R <= G``
    (so the join never holds much more than the weight pass does anyway), else ``sum``: concat for wide
    layers with few tokens per microbatch. On CPU and GPU alike that picks the faster join at small and
    large R / G; near R = G the two are close.
    """
    if mode not in ("auto", "sum", "concat"):
        raise ValueError(f"weight_join={mode!r}; choose auto, sum or concat")

    def join(stage, parts: list[WeightResiduals]):
        m = auto_weight_join(stage, parts[0], len(parts)) if mode == "auto" else mode
        join.chosen[len(parts)] = m  # what each join size took, for reports (bench pipeline)
        return concat_weight_residuals(parts) if m == "concat" else list(parts)

    join.chosen = {}
    return join


def auto_weight_join(stage, wr: WeightResiduals, k: int) -> str:
    """What ``weight_join("auto")`` does for ``k`` microbatches of ``stage`` shaped like ``wr``."""
    r, g = stage.weight_residual_bytes(wr), stage.param_bytes
    return "concat" if 2 * k * r + g < k * g and k * r <= g else "sum"
