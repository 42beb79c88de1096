"""A reduce-scatter that every backend computes right: ``psum_scatter``, or on gloo a ``psum`` and a slice.

XLA:CPU runs a multi-process JAX's collectives through gloo (``jax_cpu_collectives_implementation``, which
:func:`jaxhybrid.runtime.distributed.initialize` sets), even between two devices of one process. Its
reduce-scatter (``gloo::ReduceScatterHalvingDoubling``) sends from the caller's buffer while it writes
into it, so rank 0 of a group sometimes gets wrong values at the end of its chunk, with no error, once
the chunk passes a few hundred KiB (jax-ml/jax issue 40830; jax 0.10.2 has it). Its all-reduce is right,
so on gloo the reduce-scatter is an all-reduce and this device's slice of it, as PyTorch's gloo backend
does: twice the bytes, the same sum.
NCCL (GPUs) and one process without the distributed runtime keep the real reduce-scatter.
"""
from __future__ import annotations

import jax
from jax import lax


def gloo_collectives() -> bool:
    """Whether this process's collectives run through gloo: XLA:CPU under JAX's distributed runtime."""
    return jax.default_backend() == "cpu" and jax.distributed.is_initialized()


def psum_scatter(x: jax.Array, axis_name: str, scatter_dimension: int = 0) -> jax.Array:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`` inside ``shard_map``; on gloo
    (:func:`gloo_collectives`) the same values as ``psum`` and this device's tile of it."""
    if not gloo_collectives():
        return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    tile = x.shape[scatter_dimension] // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(lax.psum(x, axis_name), lax.axis_index(axis_name) * tile, tile,
                                    axis=scatter_dimension)
