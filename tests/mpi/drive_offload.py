"""MPI driver for the offloaded optimizer (run by tests/mpi/test_offload_mpi.py under
``mpirun -n 2 python -m mpi4py``).

Case ``data`` (G_data = 2 over a ``Split`` communicator, Myelin V-C): each rank holds the gradient of its
half of the batch; the offloaded AdamW is fed by ``iter_reduced_chunks`` (chunks of k x bsize, k = 1, 2)
and must equal, bit for bit after 5 steps, on-device AdamW (``DeviceUpdater``) applied to the sum of both
halves' gradients. Rank 1 injects an overflow at step 2: the agreed decision skips the step everywhere
and leaves the host state unchanged.

Case ``pipeline`` (G_inter = 2, the real ``PipelineEngine``): each rank offloads its own stage; 5 steps
of ``OffloadUpdater`` must equal 5 steps of ``DeviceUpdater`` bit for bit on both stages, with the
clip norm summed over stages and an injected overflow (infinite loss scale) skipped on both ranks.
Case ``allreduce-tree``: ``allreduce_tree`` over the data column keeps its reduction rules, checked bit for
bit against sums of the gathered leaves: the leaves flattened to their common dtype, half floats summed
in float32 (MPI has no half type) and cast back, times the scale in that dtype, each leaf back in its own
dtype, shape and device; the same with ``half_wire`` (``optim/half_allreduce.py``), whose
one rounding of each float32 sum at two replicas gives the same bits.
Rank 0 prints ``CASE name ok|FAIL`` lines; the exit code is 1 if any case failed.
"""
from __future__ import annotations

import functools
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from jaxhybrid.model.testing import assert_tree_close, without_key_bias
from jaxhybrid.optim.offload import OffloadedOptimizer
from jaxhybrid.optim.offload_updater import OffloadUpdater
from jaxhybrid.optim.updater import DeviceUpdater, decay_mask
from jaxhybrid.parallel.data.allreduce import allreduce_tree, iter_reduced_chunks

WORLD = MPI.COMM_WORLD
TX = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.01)
SHAPES = {"w1": (8, 16), "b1": (16,), "block": {"w2": (16, 16), "b2": (16,)}, "out": (16, 4)}


def _loss(p, x, y):
    h = jnp.tanh(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["block"]["w2"] + p["block"]["b2"])
    err = h @ p["out"] - y
    return jnp.sum(err * err) / 12.0  # the global batch has 12 rows: pre-divided (Myelin IV-B)


GRAD = jax.jit(jax.grad(_loss))


def case_data(k: int) -> None:
    comm = WORLD.Split(0, WORLD.rank)  # the data column, made on all ranks
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32), SHAPES,
                          is_leaf=lambda s: isinstance(s, tuple))
    data = [(rng.normal(size=(12, 8)).astype(np.float32), rng.normal(size=(12, 4)).astype(np.float32))
            for _ in range(5)]
    bsize = 37  # 480 parameters: does not divide
    opt = OffloadedOptimizer(TX, bsize, grad_clip=1e3, name="adamw")
    ref = DeviceUpdater(TX, 1e3)
    st, rp, rs = opt.init(params), params, ref.init(params)
    flat = opt.device_params(st)
    me = comm.rank
    for step, (x, y) in enumerate(data):
        halves = [GRAD(opt.params_tree(flat), x[r * 6:(r + 1) * 6], y[r * 6:(r + 1) * 6]) for r in (0, 1)]
        local = opt.flatten(halves[me])
        if step == 2 and me == 1:
            local = local.at[5].set(jnp.inf)  # injected overflow on one rank
        nonfinite = comm.allreduce(float(not bool(jnp.all(jnp.isfinite(local)))), op=MPI.MAX)
        before = opt.state_dict(st)
        st, flat, info = opt.step(st, chunks=iter_reduced_chunks(local, comm, k * bsize),
                                  params=flat, finite=not nonfinite)
        g = jax.tree.map(jnp.add, *[GRAD(rp, x[r * 6:(r + 1) * 6], y[r * 6:(r + 1) * 6]) for r in (0, 1)])
        sq, _ = ref.stats(g)
        rp, rs, _ = ref.apply(rp, rs, g, 1.0, sq, jnp.float32(nonfinite))
        if step == 2:
            assert info["skipped"], "injected overflow did not skip the step"
            assert_tree_close(opt.state_dict(st), before, "exact", f"rank {me} state after skipped step")
    assert_tree_close(opt.master_params(st), rp, "exact", f"rank {me} k={k} masters")
    assert_tree_close(opt.inner_state(st), rs, "exact", f"rank {me} k={k} adam state")
    comm.Free()


def case_pipeline(dtype: str = "float32") -> None:
    """A 2-stage pipeline, offloaded against the on-device update. float32: bit-exact. bfloat16: the stages
    get the bf16 compute copy (Myelin V-B) and return bf16 gradients, the on-device update fp32 masters
    and fp32 gradients of the same bf16 computation, so they agree to bf16 parity."""
    from jaxhybrid.model import Model
    from jaxhybrid.parallel.pipeline.topology import Topology
    from jaxhybrid.runtime.config_load import config_from_dict
    from jaxhybrid.runtime.engines.pipeline import PipelineEngine

    cfg = config_from_dict({
        "model": {"name": "gpt-tiny", "vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
                  "max_seq_len": 8},
        "data": {"seq_len": 8}, "train": {"steps": 5, "global_batch": 4},
        "optim": {"warmup_steps": 1, "grad_clip": 0.05, "bucket_size": 250, "offload": True},
        "parallel": {"pipeline": 2, "data": 1}, "pipeline": {"schedule": "1f1b", "microbatches": 2},
        "precision": {"compute_dtype": dtype}})
    engine = PipelineEngine(cfg, Model(cfg.model, compute_dtype=dtype), Topology.from_config(cfg))
    tx = TX
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 32, (4, 9)).astype(np.int32) for _ in range(5)]

    def run(updater):
        params = engine.init_params(jax.random.key(0))
        state = updater.init(params)
        for i, b in enumerate(batches):
            scale = np.inf if i == 3 else 1.0  # injected overflow travels the real path
            _, grads = engine.loss_and_grads(params, b, scale)
            sq, nonfinite = updater.stats(grads)
            sq, nonfinite = engine.global_sum(sq), engine.global_max(nonfinite)
            params, state, _ = updater.apply(params, state, grads, scale, sq, nonfinite)
            assert (float(nonfinite) == 1.0) == (i == 3), f"step {i}: nonfinite={float(nonfinite)}"
        return params, state

    off = OffloadUpdater(tx, cfg)
    p_dev, _ = run(DeviceUpdater(tx, cfg.optim.grad_clip, decay_mask(cfg.optim)))
    p_off, s_off = run(off)
    assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(p_off)), "the stages get the compute copy"
    tol, view = "exact", lambda t: t
    if dtype != "float32":
        # The key part of a qkv bias holds rounding noise that AdamW scales up: left out of bf16 parity.
        tol, view = "bf16_parity", functools.partial(without_key_bias, model=cfg.model)
    assert_tree_close(view(p_off), view(p_dev), tol, f"stage {engine.stage_index} device params")
    assert_tree_close(view(off.opt.master_params(s_off)), view(p_dev), tol, f"stage {engine.stage_index} masters")
    engine.close()


def case_allreduce_tree() -> None:
    comm = WORLD.Split(0, WORLD.rank)
    rng = np.random.default_rng(WORLD.rank)

    def make(dtypes):
        return {"a": jnp.asarray(rng.normal(size=(5, 7)), dtypes[0]), "z": jnp.zeros((0, 3), dtypes[1]),
                "b": [jnp.asarray(rng.normal(size=(11,)) * 1e3, dtypes[1]), jnp.asarray(rng.normal(), dtypes[0])]}

    for dtypes in ((jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32)):
        tree = make(dtypes)
        common = jnp.result_type(*dtypes)
        wire = np.float32 if common == jnp.bfloat16 else common
        gathered = comm.allgather(jax.tree.map(np.asarray, tree))
        for scale in (None, 0.3):
            def want(*xs, dt):
                total = sum(np.asarray(x, common).astype(wire) for x in xs).astype(common)
                return (total if scale is None else total * np.asarray(scale, common)).astype(dt)

            ref = jax.tree.map(lambda x, *xs: want(*xs, dt=x.dtype), tree, *gathered)
            # Two replicas: the half-precision all-reduce rounds the float32 sum once, as the float32 wire does.
            for half_wire in (False, True):
                got = allreduce_tree(tree, comm, 4, scale, half_wire=half_wire)
                assert jax.tree.structure(got) == jax.tree.structure(tree)
                for g, r, x in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(tree)):
                    assert g.dtype == x.dtype and g.shape == x.shape and g.sharding == x.sharding, (g, x)
                    assert np.asarray(g).tobytes() == r.tobytes(), (dtypes, scale, half_wire, np.asarray(g), r)
    comm.Free()


def run_cases(cases) -> int:
    """Run ``(name, fn)`` cases on every rank; rank 0 prints ``CASE name ok|FAIL``; 1 if any failed."""
    failures = 0
    for name, fn in cases:
        try:
            fn()
            ok = 1
        except Exception:
            traceback.print_exc()
            ok = 0
        ok = WORLD.allreduce(ok, op=MPI.MIN)
        failures += 1 - ok
        if WORLD.rank == 0:
            print(f"CASE {name} {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failures else 0


def main() -> int:
    return run_cases((("data-k1", lambda: case_data(1)), ("data-k2", lambda: case_data(2)),
                      ("pipeline-2stage", case_pipeline), ("pipeline-2stage-bf16", lambda: case_pipeline("bfloat16")),
                      ("allreduce-tree", case_allreduce_tree)))


if __name__ == "__main__":
    sys.exit(main())
