"""Tied embeddings across pipeline stages (Megatron's embedding all-reduce).

With ``model.tie_embeddings`` the first stage owns ``embed.wte`` and the last stage holds a copy under
``TIED_KEY`` for its head. Both copies must receive the same update, so after the pipeline phase each
of the two ranks adds the other's gradient of the shared table (:func:`sum_tied`); the global gradient
norm then counts that summed gradient once (:func:`norm_view`).
"""
from __future__ import annotations

import jax
import numpy as np

from jaxhybrid.model.transformer import TIED_KEY

_TAG = 7  # the Sendrecv tag of the tied-gradient exchange on the pipeline row


def sum_tied(grads: dict, stage_to_rank: tuple[int, ...], row_rank: int, tied: bool, row) -> dict:
    """This rank's gradients with the tied table's gradient summed over the first and the last stage.

    Args:
      grads: the gradient dict of the stages this rank runs (their parts, merged).
      stage_to_rank: the pipeline row rank of every logical stage.
      row_rank: this rank's place in the row.
      tied: ``model.tie_embeddings``.
      row: the pipeline row's communicator (mpi4py). Unused where one rank holds both ends (ZB-V's
        placement): the two copies are summed in place, with no exchange.
    """
    first_rank, last_rank = stage_to_rank[0], stage_to_rank[-1]
    if not tied or len(stage_to_rank) == 1 or row_rank not in (first_rank, last_rank):
        return grads
    if first_rank == last_rank:
        own, copy = grads["embed"]["wte"], grads[TIED_KEY]
        total = own + copy  # first + last, as the two ranks of an exchange sum them
        return {**grads, "embed": {**grads["embed"], "wte": total.astype(own.dtype)}, TIED_KEY: total.astype(copy.dtype)}
    first = row_rank == first_rank
    peer = last_rank if first else first_rank
    g = grads["embed"]["wte"] if first else grads[TIED_KEY]
    mine = np.ascontiguousarray(np.asarray(g, np.float32))
    other = np.empty_like(mine)
    row.Sendrecv(mine, dest=peer, sendtag=_TAG, recvbuf=other, source=peer, recvtag=_TAG)
    # Same summation order on both ranks (first + last) so the two copies stay bit-identical.
    total = jax.device_put((mine + other if first else other + mine).astype(g.dtype), g.sharding)
    if first:
        return {**grads, "embed": {**grads["embed"], "wte": total}}
    return {**grads, TIED_KEY: total}


def norm_view(grads: dict) -> dict:
    """The gradients a rank contributes to the global norm: the tied copy holds the same summed gradient
    as the first stage's ``embed.wte``, so only ``embed.wte`` counts it (one copy, on whichever rank)."""
    if TIED_KEY in grads:
        return {k: v for k, v in grads.items() if k != TIED_KEY}
    return grads
