"""MPI driver for the half-precision all-reduce (run by tests/mpi/test_offload_mpi.py under
``mpirun -n 3 python -m mpi4py``; three ranks so chunks are padded and three slices meet in each sum).

Case ``half-sum``: for bfloat16 and float16 vectors of several lengths (shorter than the rank count, not a
multiple of it, a multiple of it), ``allreduce_tree`` and ``iter_reduced_chunks`` with ``half_wire`` give,
on every rank, exactly the float32 sum of the ranks' vectors in rank order, rounded once to the half dtype,
whatever the offset of an element (the same bits for a tied embedding at two offsets).

Case ``engine``: a ``PipelineEngine`` of one stage x 3 replicas built from a config with
``optim.allreduce_dtype: compute`` (bf16, offloaded optimizer) reduces through ``half_sum`` on both paths,
whole (``loss_and_grads``) and streamed (``loss_and_grad_chunks``), to the rank-order sum of the replicas'
unreduced gradients; with ``float32`` it does not call it.
Rank 0 prints ``CASE name ok|FAIL`` lines; the exit code is 1 if any failed.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxhybrid.parallel.data import half_allreduce
from jaxhybrid.parallel.data.allreduce import allreduce_tree, iter_reduced_chunks

WORLD = MPI.COMM_WORLD


def rank_order_sum(xs: list[np.ndarray], dtype) -> np.ndarray:
    """The float32 sum of ``xs`` (rank 0 first), rounded once to ``dtype``."""
    total = xs[0].astype(np.float32)
    for x in xs[1:]:
        total = total + x.astype(np.float32)
    return total.astype(dtype)


def case_half_sum() -> None:
    comm = WORLD.Split(0, WORLD.rank)
    rng = np.random.default_rng(WORLD.rank)
    for dtype in (jnp.bfloat16, jnp.float16):
        for n in (2, 10, 12, 1001):
            x = np.asarray(rng.normal(size=n) * 3.0, dtype)
            xs = comm.allgather(x)
            want = rank_order_sum(xs, dtype)
            got = np.asarray(allreduce_tree({"g": jnp.asarray(x)}, comm, 4, half_wire=True)["g"])
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (dtype, n, got, want)
            # The streamed path (V-C) reduces chunks of 7 with other offsets: the same bits per element.
            chunks = list(iter_reduced_chunks(jnp.asarray(x), comm, 7, half_wire=True))
            assert [(s, e) for s, e, _ in chunks] == [(s, min(s + 7, n)) for s in range(0, n, 7)]
            assert np.concatenate([np.asarray(r) for _, _, r in chunks]).tobytes() == want.tobytes(), (dtype, n)
    # Not freed: the jitted reductions are cached by the communicator's handle, which MPI may hand out again.


def case_engine() -> None:
    from jaxhybrid.model import Model
    from jaxhybrid.parallel.data.flat import FlatSpec
    from jaxhybrid.parallel.pipeline.topology import Topology
    from jaxhybrid.runtime.config_load import config_from_dict
    from jaxhybrid.runtime.engines.pipeline import PipelineEngine

    calls = []
    traced = half_allreduce.half_sum
    half_allreduce.half_sum = lambda x, comm: calls.append(x.shape) or traced(x, comm)  # noqa: E731
    batch = np.random.default_rng(1).integers(0, 32, (6, 9)).astype(np.int32)
    try:
        for wire in ("compute", "float32"):
            cfg = config_from_dict({
                "model": {"name": "gpt-tiny", "vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2,
                          "d_ff": 32, "max_seq_len": 8},
                "data": {"seq_len": 8}, "train": {"steps": 1, "global_batch": 6},
                "optim": {"bucket_size": 250, "offload": True, "allreduce_dtype": wire},
                "parallel": {"pipeline": 1, "data": 3}, "pipeline": {"microbatches": 2},
                "precision": {"compute_dtype": "bfloat16"}})
            engine = PipelineEngine(cfg, Model(cfg.model, compute_dtype="bfloat16"), Topology.from_config(cfg))
            params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), engine.init_params(jax.random.key(0)))
            calls.clear()
            _, mine = engine._pipeline_phase(params, batch, 1.0)  # this replica's unreduced gradients
            spec = FlatSpec(mine)
            want = rank_order_sum(engine.topo.column.allgather(np.asarray(spec.ravel(mine))), jnp.bfloat16)
            _, whole = engine.loss_and_grads(params, batch, 1.0)
            _, chunks = engine.loss_and_grad_chunks(params, batch, 1.0, spec.ravel)
            streamed = np.concatenate([np.asarray(r) for _, _, r in chunks])
            if wire == "compute":
                assert calls, "optim.allreduce_dtype=compute: the engine never reduced through half_sum"
                for got in (np.asarray(spec.ravel(whole)), streamed):
                    assert got.tobytes() == want.tobytes(), wire
            else:
                assert not calls, f"optim.allreduce_dtype=float32 reduced through half_sum: {calls}"
            engine.close()
    finally:
        half_allreduce.half_sum = traced


if __name__ == "__main__":
    from drive_offload import run_cases  # this folder is the script's: on sys.path

    sys.exit(run_cases((("half-sum", case_half_sum), ("engine", case_engine))))
