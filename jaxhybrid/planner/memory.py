"""Memory per device: Myelin's parameter-state model (Sec. V-B), activations (Sec. V-A) and schedules.

* Parameter state without offload: 20 phi bytes (fp32 theta and grad: 4 + 4, fp16 copies 2 + 2, Adam 8).
* With the bucketed host offload: 4 phi + 16 bsize (fp16 theta and grad stay; one bucket of fp32 theta,
  Adam state and descaled gradient visits the device at a time).
* AxoNN shards parameter state over the tensor grid: phi / (G_d G_r G_c) per device (Alg. 1, DIVIDE_WEIGHTS).
* Stashed microbatches per pipeline rank come from the schedule module (:func:`stashed_microbatches`).
* Checkpointing (Myelin Sec. V-A): M_activation = G_inter (N / (G_inter ac) + 1 + ac) layer outputs, with
  ac the factor of N / G_inter closest to sqrt(N).
"""
from __future__ import annotations

import math

from jaxhybrid.config import optimal_checkpoint_interval

__all__ = ["param_state_bytes", "myelin_activation_units", "optimal_checkpoint_interval",
           "stashed_microbatches", "block_activation_bytes", "boundary_bytes"]


def param_state_bytes(phi: float, offload: bool = False, bucket_size: float = 0, tensor_size: int = 1) -> float:
    """Bytes of parameters, gradients and Adam state on one device (Myelin Sec. V-B).

    Args:
      phi: parameters held by this pipeline stage (before tensor sharding).
      offload: Myelin's bucketed optimizer offload.
      bucket_size: bsize, elements per offload bucket.
      tensor_size: G_c x G_r x G_d; AxoNN shards all parameter state over the grid.
    """
    if phi < 0 or bucket_size < 0 or tensor_size < 1:
        raise ValueError(f"phi={phi}, bucket_size={bucket_size} must be >= 0 and tensor_size={tensor_size} >= 1")
    shard = phi / tensor_size
    if offload:
        return 4 * shard + 16 * min(bucket_size, shard)
    return 20 * shard


def myelin_activation_units(n_layers: int, g_inter: int, ac: int) -> float:
    """Myelin Sec. V-A: peak stored activations per GPU, in layer outputs, with checkpoint interval ac."""
    if ac < 1 or g_inter < 1 or n_layers < 1:
        raise ValueError(f"n_layers={n_layers}, g_inter={g_inter}, ac={ac} must be >= 1")
    return g_inter * (n_layers / (g_inter * ac) + 1 + ac)


def stashed_microbatches(schedule: str, stages: int, microbatches: int, split_backward: bool = False,
                         ) -> list[int]:
    """Peak microbatches each rank keeps, from the schedule generator's rows (the simulator's count).

    GPipe keeps all m; 1F1B keeps min(m, N - rank); with 2BP a microbatch stays until its weight pass
    (the residuals of the input pass), which 2BP runs last, so every rank keeps all m.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages={stages} and microbatches={microbatches} must be >= 1")
    from jaxhybrid.pipeline.schedule import make_schedule
    from jaxhybrid.pipeline.validate import peak_stashed

    return peak_stashed(make_schedule(schedule, stages, microbatches, split_backward))


def block_activation_bytes(seq: int, microbatch: int, d_model: int, n_heads: int, dtype_bytes: int = 2,
                           remat: str = "none") -> float:
    """Stored activations of one transformer block for one microbatch (Korthikanti et al. 2022, eq. 2).

    ``s b h (34 + 5 a s / h)`` bytes in 16-bit; rescaled to ``dtype_bytes``. With full recomputation
    only the block input is kept (``dtype_bytes * s b h``).
    """
    sbh = seq * microbatch * d_model
    if remat == "full":
        return dtype_bytes * sbh
    return sbh * (34 + 5 * n_heads * seq / d_model) * dtype_bytes / 2


def boundary_bytes(seq: int, microbatch: int, d_model: int, dtype_bytes: int = 2) -> float:
    """One hidden state: what crosses a pipeline boundary and what a checkpoint keeps."""
    return float(seq * microbatch * d_model * dtype_bytes)


def checkpointed_stage_bytes(n_layers: int, g_inter: int, stash: float, block_bytes: float,
                             boundary: float) -> float:
    """Activations of a stage with Myelin's checkpointing: per stashed microbatch the checkpoints of its
    N / (G_inter ac) segments, plus the live segment recomputed in the backward (ac full blocks)."""
    ac = optimal_checkpoint_interval(n_layers, g_inter)
    per_stage = max(1, n_layers // g_inter)
    return stash * math.ceil(per_stage / ac) * boundary + ac * block_bytes
