"""Multi-process AxoNN 4D through JAX's own distributed runtime, and a self-check runnable on CPU.

:func:`initialize` starts ``jax.distributed`` before any JAX computation; the mesh then spans every
process's devices and :class:`TensorEngine` runs unchanged (``jaxhybrid train --distributed`` calls it).
Peers are found from the launcher (:func:`peer_arguments`): explicit arguments, else Slurm (JAX reads
``SLURM_*``), else the MPI job that started the process (mpirun / ``jaxhybrid launch``: rank 0 picks a
free port and broadcasts ``host:port`` with mpi4py). On CPU the cross-process collectives are gloo's.

``python -m jaxhybrid.runtime.distributed --process-id I --num-processes N --port P`` runs one tiny-GPT
step on the global mesh in each process and checks loss and gradients (gathered to every process)
against the single-device engine; it exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from jaxhybrid.core import launch_env
from jaxhybrid.parallel.pipeline.watchdog import install_abort_on_exception


def peer_arguments(coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, env=None) -> dict:
    """Keyword arguments of ``jax.distributed.initialize`` for this process.

    All three given: used as they are. None given: ``{}`` under Slurm (JAX's own detection), the MPI
    job's size, rank and a coordinator chosen by rank 0 under an MPI launcher; anything else is an error
    naming what to pass. Checked before the runtime starts, so a bad launch fails without a hang.
    """
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"--distributed with explicit peers needs all of --coordinator HOST:PORT, "
                             f"--num-processes N and --process-id I; missing {', '.join(missing)}")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator {coordinator!r} must be HOST:PORT (process 0's address)")
        if not 1 <= int(port) <= 65535:  # else the runtime's bind or connect fails after the processes start
            raise ValueError(f"--coordinator {coordinator!r}: port {int(port)} must be in [1, 65535]")
        if num_processes < 1:
            raise ValueError(f"--num-processes {num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must be in [0, --num-processes {num_processes})")
        return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}
    if launch_env.slurm_task(env):
        return {}
    if launch_env.mpi_rank_set(env):
        return _from_mpi()
    raise ValueError("--distributed found no launcher (neither srun nor mpirun started this process); start "
                     "every process with `srun`, `mpirun`/`jaxhybrid launch`, or pass --coordinator HOST:PORT "
                     "--num-processes N --process-id I to each")


def _from_mpi() -> dict:
    """Size and rank of MPI's world; rank 0 binds a free port and broadcasts ``host:port``.
    (JAX's own mpi4py detection derives the port from a hash of the host name: two jobs on one node
    would collide.)"""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    addr = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = f"{socket.gethostname()}:{s.getsockname()[1]}"
    addr = comm.bcast(addr, root=0)
    return {"coordinator_address": addr, "num_processes": comm.Get_size(), "process_id": comm.Get_rank()}


def devices_per_process(mesh_devices: int, n: int) -> int:
    """Each of ``n`` processes' share of a mesh of ``mesh_devices``; ValueError when it does not split."""
    if mesh_devices % n:
        raise ValueError(f"--distributed over {n} processes: the mesh's {mesh_devices} devices (data x depth x row "
                         f"x col) do not split evenly; start a number of processes dividing {mesh_devices}")
    return mesh_devices // n


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_devices: int | None = None, mesh_devices: int | None = None) -> None:
    """Start the distributed runtime (see :func:`peer_arguments`). Must run before any JAX computation.

    Args:
      local_devices: fake CPU devices per process (sets XLA_FLAGS; only before the backend starts).
      mesh_devices: devices of the whole mesh; each process then takes its node-local block of
        ``mesh_devices / processes`` GPUs (:func:`~jaxhybrid.parallel.tensor.local.gpu_block`). Without it JAX keeps
        only GPU ``SLURM_LOCALID`` per process under Slurm, and all visible GPUs elsewhere.
    """
    from jaxhybrid.parallel.tensor.local import gpu_block

    kwargs = peer_arguments(coordinator, num_processes, process_id)
    if mesh_devices:
        n = kwargs.get("num_processes") or launch_env.world_size()  # {} only under srun: its task count
        ids = gpu_block(devices_per_process(mesh_devices, n))
        if ids is not None:
            kwargs["local_device_ids"] = ids
    if local_devices:  # read when the CPU backend starts (first device query), not at import
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    import jax

    # Cross-process collectives of the CPU backend (GPU backends use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


def abort_on_exception() -> None:
    """Make an uncaught exception in this process end the whole job, naming the process, as a pipeline
    rank's does (:func:`~jaxhybrid.parallel.pipeline.watchdog.install_abort_on_exception`). Why: its peers wait for
    it in the step's collectives, and its own exit waited for them in jax.distributed's shutdown barrier
    (an exit hook), so a process that raised mid-run left both waiting until the launcher's timeout. Under
    an MPI launcher ``MPI_Abort`` ends every process; elsewhere (srun, explicit peers) this process exits
    at once, leaving its peers to the coordination service's missed heartbeats or srun."""
    import jax

    mpi = sys.modules.get("mpi4py.MPI")  # imported by _from_mpi or `python -m mpi4py`: an MPI job
    install_abort_on_exception(f"process {jax.process_index()} of {jax.process_count()} (--distributed)",
                               mpi.COMM_WORLD if mpi is not None else None)


def check_step(shape: tuple[int, int, int, int], letters: str = "ABCDE") -> float:
    """One step on the global mesh vs the single-device engine in this process; returns the loss."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxhybrid.model import Model
    from jaxhybrid.model.testing import assert_tree_close
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.engines.base import LocalEngine
    from jaxhybrid.runtime.engines.tensor import TensorEngine

    d, dep, r, c = shape
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layers=1", "train.global_batch=8",
                             "data.seq_len=8", f"parallel.data={d}", f"parallel.tensor_depth={dep}",
                             f"parallel.tensor_row={r}", f"parallel.tensor_col={c}",
                             f"tensor.optimizations={letters}"])
    batch = np.random.RandomState(0).randint(0, 256, (8, 9)).astype(np.int32)
    eng = TensorEngine(cfg.model, cfg)
    loss, grads = eng.loss_and_grads(eng.init_params(jax.random.key(0)), batch, 1.0)
    grads = multihost_utils.process_allgather(grads, tiled=True)
    loss = multihost_utils.process_allgather(loss, tiled=True)
    with jax.default_device(jax.local_devices()[0]):
        ref = LocalEngine(Model(cfg.model))
        loss_r, grads_r = ref.loss_and_grads(ref.init_params(jax.random.key(0)), batch, 1.0)
    assert_tree_close(loss, jax.device_get(loss_r), "fp32_parity", f"process {jax.process_index()} loss")
    assert_tree_close(grads, jax.device_get(grads_r), "fp32_parity", f"process {jax.process_index()} grads")
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--shape", default="2,1,2,2", help="G_data,G_d,G_r,G_c over all processes' devices")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    initialize(f"localhost:{args.port}", args.num_processes, args.process_id, args.local_devices)
    loss = check_step(tuple(int(v) for v in args.shape.split(",")))
    print(f"process {args.process_id}: loss {loss:.6f} matches the single-device step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
