"""Multi-process AxoNN 4D through JAX's own distributed runtime, and a self-check runnable on CPU.

``initialize`` starts ``jax.distributed`` (on CPU with gloo collectives, so two processes on one machine
form one 8-device mesh); the mesh then spans every process's devices and :class:`TensorEngine` runs
unchanged. ``python -m jaxhybrid.tensor.distributed --process-id I --num-processes N --port P`` runs one
tiny-GPT step on the global mesh in each process and checks loss and gradients (gathered to every
process) against the single-device engine; it exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys


def initialize(process_id: int, num_processes: int, coordinator: str, local_devices: int | None = None,
               cpu: bool = False) -> None:
    """Start the distributed runtime. Must run before any JAX computation.

    Args:
      process_id, num_processes, coordinator: as ``jax.distributed.initialize`` (``host:port`` of process 0).
      local_devices: fake CPU devices per process (sets XLA_FLAGS; only before the backend starts).
      cpu: use the CPU backend with gloo cross-process collectives.
    """
    if local_devices:  # read when the CPU backend starts (first device query), not at import
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    import jax

    if cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def check_step(shape: tuple[int, int, int, int], letters: str = "ABCDE") -> float:
    """One step on the global mesh vs the single-device engine in this process; returns the loss."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxhybrid.config import load_config
    from jaxhybrid.model import Model
    from jaxhybrid.step import LocalEngine
    from jaxhybrid.tensor.engine import TensorEngine
    from jaxhybrid.testing import assert_tree_close

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
    initialize(args.process_id, args.num_processes, f"localhost:{args.port}", args.local_devices, cpu=True)
    loss = check_step(tuple(int(v) for v in args.shape.split(",")))
    print(f"process {args.process_id}: loss {loss:.6f} matches the single-device step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
