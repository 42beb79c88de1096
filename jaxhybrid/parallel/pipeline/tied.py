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


def sum_tied(grads: dict, stage: int, num_stages: int, tied: bool, row) -> dict:
    """The stage's gradients with the tied table's gradient summed over the first and last stage.

    Args:
      grads: this stage's gradient dict.
      stage, num_stages: this rank's stage index and the pipeline depth.
      tied: ``model.tie_embeddings``.
      row: the pipeline row's communicator (mpi4py), where stage i is rank i.
    """
    if not tied or num_stages == 1 or stage not in (0, num_stages - 1):
        return grads
    first = stage == 0
    peer = num_stages - 1 if first else 0
    g = grads["embed"]["wte"] if first else grads[TIED_KEY]
    mine = np.ascontiguousarray(np.asarray(g, np.float32))
    other = np.empty_like(mine)
    row.Sendrecv(mine, dest=peer, sendtag=_TAG, recvbuf=other, source=peer, recvtag=_TAG)
    # Same summation order on both ranks (first + last) so the two copies stay bit-identical.
    total = jax.device_put((mine + other if first else other + mine).astype(g.dtype), g.sharding)
    if first:
        return {**grads, "embed": {**grads["embed"], "wte": total}}
    return {**grads, TIED_KEY: total}


def norm_view(grads: dict, stage: int) -> dict:
    """The gradients a stage contributes to the global norm: the last stage's tied copy holds the same
    summed gradient as the first stage's ``embed.wte``, so only the first stage counts it."""
    if TIED_KEY in grads and stage != 0:
        return {k: v for k, v in grads.items() if k != TIED_KEY}
    return grads
