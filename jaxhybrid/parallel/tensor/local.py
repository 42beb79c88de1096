"""Tensor parallelism inside one pipeline rank: hybrid pipeline x tensor x data (AxoNN-4D Sec. V).

In the hybrid layout the Myelin grid ``G_inter x G_data`` is MPI ranks (stages and data replicas exchange
activations and all-reduce gradients over MPI), and every rank drives a local mesh ``(1, G_d, G_r, G_c)`` of
its own devices: the same :class:`~jaxhybrid.parallel.tensor.ops.TensorOps` the whole-model engine uses, injected
into the stage's model, so the stage's forward / backward_input / backward_weight kernels are
``shard_map`` islands with AxoNN's collectives and the model code does not change. The mesh's data axis
has size 1 here: data parallelism is the MPI column, as in Myelin.

A rank's devices are ``jax.local_devices()`` when it sees exactly ``G_d G_r G_c`` of them (one GPU set per
rank via ``CUDA_VISIBLE_DEVICES``, or ``--xla_force_host_platform_device_count`` on CPU), otherwise the
block of its node-local rank (``MPI_LOCALRANKID`` / ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``SLURM_LOCALID``).
"""
from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.core.launch_env import accelerator_backend, local_rank
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.parallel.tensor.mesh import BATCH, make_mesh
from jaxhybrid.parallel.tensor.ops import STREAM, TensorOps
from jaxhybrid.parallel.tensor.sharding import check_layout, param_shardings


def gpu_block(per_rank: int, env=None, node_gpus: int | None = None) -> list[int] | None:
    """The GPUs a process started by MPI or Slurm should use, as ``jax_cuda_visible_devices`` (and
    ``jax.distributed``'s ``local_device_ids``) take them, i.e. positions in ``CUDA_VISIBLE_DEVICES`` when
    that is set: the block of ``per_rank`` GPUs of its node-local rank, or all ``per_rank`` it sees when
    the launcher already gave it exactly that many (``srun --gpus-per-task``). None when no launcher names
    a local rank (one process keeps every device). ``node_gpus``: the GPUs the node shows without
    ``CUDA_VISIBLE_DEVICES`` (default: its ``/dev/nvidia<N>`` files where JAX will compute on an
    accelerator, else 0; 0 checks nothing).

    Why: a process that sees all of its node's GPUs computes on the first one and JAX preallocates most
    of every visible GPU's memory, so ranks sharing a node would pile onto GPU 0 and run out of memory;
    and under Slurm ``jax.distributed`` would otherwise keep only GPU ``SLURM_LOCALID`` per process. A
    block past the node's GPUs is an error here, before the backend starts, rather than a rank without a GPU.
    Applied before the backend starts (``jaxhybrid train``); a CPU-only JAX ignores the setting.
    """
    env = os.environ if env is None else env
    r = local_rank(env)
    if r is None:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = len([v for v in visible.split(",") if v.strip()])
        if n == per_rank:
            return list(range(per_rank))
        seen = f"CUDA_VISIBLE_DEVICES={visible!r} lists {n}"
    else:
        n = node_gpus if node_gpus is not None else (
            len(glob.glob("/dev/nvidia[0-9]*")) if accelerator_backend(env) else 0)  # JAX on the CPU: no GPU
        seen = f"the node has {n} (/dev/nvidia<N>)"
    if n and n < per_rank * (r + 1):
        raise ValueError(f"node-local rank {r} needs GPUs {r * per_rank}..{(r + 1) * per_rank - 1} of its "
                         f"node ({per_rank} per rank) but {seen}; start fewer ranks per node, give each rank "
                         f"its own GPUs, or let ranks share {per_rank} with CUDA_VISIBLE_DEVICES naming them "
                         f"and XLA_PYTHON_CLIENT_MEM_FRACTION each rank's share of their memory")
    return list(range(r * per_rank, (r + 1) * per_rank))


def use_gpu_block(per_rank: int) -> None:
    """Make :func:`gpu_block` this process's only GPUs (``jax_cuda_visible_devices``), for a rank that joins
    no distributed runtime (:func:`jaxhybrid.runtime.distributed.initialize` passes the block itself).
    Before the backend starts; nothing where no launcher names a local rank."""
    if (ids := gpu_block(per_rank)) is not None:
        jax.config.update("jax_cuda_visible_devices", ",".join(map(str, ids)))


def rank_devices(n: int, devices: list | None = None, node_rank: int | None = None) -> list:
    """The ``n`` devices this rank's tensor mesh uses; ValueError naming the counts and the fix."""
    devs = list(jax.local_devices() if devices is None else devices)
    if len(devs) == n:
        return devs
    r = (local_rank() or 0) if node_rank is None else node_rank
    if len(devs) >= n * (r + 1):
        return devs[r * n:(r + 1) * n]
    raise ValueError(
        f"this rank (node-local rank {r}) needs parallel.tensor_depth x tensor_row x tensor_col = {n} local "
        f"devices and sees {len(devs)} ({devs[0].platform if devs else 'none'}); on CPU launch with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n}, on GPUs give every rank {n} GPUs "
        f"(CUDA_VISIBLE_DEVICES) or a node with {n} GPUs per rank")


@dataclasses.dataclass(frozen=True)
class LocalTensor:
    """One rank's tensor mesh, its ops object and the shardings of a stage's parameters and messages."""

    mesh: Any
    ops: TensorOps

    @classmethod
    def from_config(cls, cfg, devices: list | None = None) -> "LocalTensor":
        """Checks every divisibility rule (names the values) before building anything."""
        m, lay = cfg.model, cfg.layout
        # This rank's stage: its own mesh, without the data replicas (other ranks).
        dims = ParallelDims.from_mesh_shape((1, lay.tensor_depth, lay.tensor_row, lay.tensor_col))
        check_layout(m, dims, cfg.microbatch_size, cfg.tensor.optimizations)
        mesh = make_mesh(dims, rank_devices(dims.tensor_size, devices))
        return cls(mesh, TensorOps.build(mesh, m.n_heads, m.kv_heads, cfg.tensor.optimizations))

    def param_shardings(self, params: Any) -> Any:
        return param_shardings(params, self.mesh, self.ops.letters)

    @property
    def activation_sharding(self) -> NamedSharding:
        """Stage-boundary activations / their gradients ``[mb, T, d]``: the residual stream's layout."""
        return NamedSharding(self.mesh, P(BATCH, None, STREAM))
