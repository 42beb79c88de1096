"""The 4D AxoNN mesh ``(data, depth, row, col)`` and the layout rules every tensor-parallel op shares.

Axis order follows AxoNN Sec. V's hierarchy read outermost first: data, depth, row, column (column is
innermost, so on a real machine a column group is the most tightly coupled set of devices). The mesh uses
``AxisType.Auto`` on purpose: the model runs in global view under ``jit`` and only the parallelism-
sensitive ops are explicit ``shard_map`` islands; between islands the compiler partitions the glue
(reshapes, RoPE, residual adds) and inserts a re-layout where one is unavoidable (the qkv output, when
the head counts do not divide the axis that carries it and the heads are replicated over it).
"""
from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.core.layout import MESH_AXES, ParallelDims

AXES = MESH_AXES
DATA, DEPTH, ROW, COL = AXES
BATCH = (DATA, DEPTH)  # the rows m of X (batch) are split over data replicas and depth (Alg. 1 line 8)
# The same rows inside ``jax.vmap`` over the data replicas (TensorEngine with microbatches: eq. 8 once per
# step); vmap's ``spmd_axis_name`` puts data on the replica dimension.
REPLICA_BATCH = (DEPTH,)


def make_mesh(dims: ParallelDims, devices=None) -> Mesh:
    """A ``Mesh`` of one stage's grid (:attr:`~jaxhybrid.core.layout.ParallelDims.mesh_shape`) with axes
    ``(data, depth, row, col)`` and explicit ``AxisType.Auto`` axis types.

    Devices are laid out row-major, so ``col`` neighbours are adjacent device ids (innermost, Sec. V).
    """
    devs = list(jax.devices() if devices is None else devices)
    dims.check_devices(len(devs))
    arr = np.asarray(devs, dtype=object).reshape(dims.mesh_shape)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * 4)


def factorizations(n: int, parts: int = 4) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n`` (the search space)."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return [t for t in itertools.product(divs, repeat=parts) if int(np.prod(t)) == n]


def named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


def reduce_data_once(data: int, microbatches: int, dtype_bytes: int) -> bool:
    """Whether the tensor engine all-reduces gradients over data once per step, after its microbatch scan
    (float32, 4 bytes per gradient), rather than in every layer's backward of every microbatch (AxoNN eq.
    8 in the compute dtype, ``microbatches x dtype_bytes``, which XLA:GPU may overlap with the backward):
    only where it moves fewer bytes. The engine and the planner's step model both ask this."""
    return data > 1 and microbatches * dtype_bytes > 4
