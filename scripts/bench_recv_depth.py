"""Pre-posted receives (Myelin Sec. IV-A) against probe-on-demand, side by side on the mpi4py transport.

    jaxhybrid launch -n 2 --timeout 600 --script scripts/bench_recv_depth.py -- [--model gpt-tiny] [--rounds 7]

Ranks pin themselves as `jaxhybrid train` ranks do. ``recv_depth=0`` (``Improbe`` + ``Mrecv`` when the
loop polls) and ``recv_depth=2`` (posted ``Irecv``s) alternate round by round, so machine noise hits
both alike. Two measurements, medians over the rounds:

- ``exposed_ms``: rank 1 sends 2 messages of each size while rank 0 runs a kernel of about
  ``--compute-ms``; the time rank 0 then takes to have both (what pre-posting may hide). Whether they
  landed during the kernel is not observable apart: only an MPI call (which makes progress) can tell;
- ``step_s``: a 1F1B pipeline step over the stages of ``--model`` (PipelineEngine, one set of compiled
  stages; only the event loop's transport differs), barrier to the slowest rank's end of the phase.
Prints one JSON object on rank 0.
"""
from __future__ import annotations

import argparse
import json
import time

from jaxhybrid.core.launch_env import bind_rank_cpus

bind_rank_cpus()  # before JAX sizes its thread pool (a --script is not pinned by the launcher)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jaxhybrid.bench.pipeline import step_wall  # noqa: E402
from jaxhybrid.parallel.pipeline.mpi4py_transport import Mpi4pyTransport  # noqa: E402
from jaxhybrid.parallel.pipeline.transport import Envelope, MsgKind, wait_message  # noqa: E402

DEPTHS = (0, 2)


def kernel_for(ms: float):
    """A jitted float32 matmul chain and its argument, sized to about ``ms`` milliseconds here."""
    x = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
    jax.block_until_ready(step(x))
    t0 = time.perf_counter()
    jax.block_until_ready(step(x))
    reps = max(1, round(ms / max(1e3 * (time.perf_counter() - t0), 1e-3)))

    def run():
        y = x
        for _ in range(reps):
            y = step(y)
        return jax.block_until_ready(y)

    return run


def exposed(world, t, compute, size: int) -> float:
    """Rank 0's time to receive rank 1's two messages after its kernel."""
    world.Barrier()
    if world.rank == 1:
        for mb in range(2):
            t.send(np.full(size // 4, mb, np.float32), 0, Envelope(MsgKind.ACT, mb, 0))
        t.flush()
    if world.rank != 0:
        return 0.0
    compute()
    t0 = time.perf_counter()
    for _ in range(2):
        wait_message(t)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--sizes-kib", default="64,4096", help="message sizes of the exposed-time measurement")
    a = ap.parse_args()
    from jaxhybrid.model import Model
    from jaxhybrid.parallel.pipeline.topology import Topology
    from jaxhybrid.runtime.config_load import config_from_dict
    from jaxhybrid.runtime.engines.pipeline import PipelineEngine

    world = MPI.COMM_WORLD
    p, m = world.size, 2 * world.size
    cfg = config_from_dict({
        "model": {"name": a.model, "n_layers": max(4, p), "max_seq_len": a.seq}, "data": {"seq_len": a.seq},
        "train": {"global_batch": m * a.microbatch_size}, "parallel": {"pipeline": p, "data": 1},
        "pipeline": {"schedule": "1f1b", "microbatches": m, "transport": "mpi4py", "watchdog_s": 600.0}})
    topo = Topology.from_config(cfg)
    engine = PipelineEngine(cfg, Model(cfg.model), topo)  # its transport: the default depth
    template = engine.transport.template
    step_ts = {d: engine.transport if d == engine.transport.recv_depth else
               Mpi4pyTransport(topo.p2p, template, recv_depth=d) for d in DEPTHS}
    sizes = [int(s) * 1024 for s in a.sizes_kib.split(",")]
    probe_ts = {(d, s): Mpi4pyTransport(topo.p2p, jax.ShapeDtypeStruct((s // 4,), jnp.float32), recv_depth=d)
                for d in DEPTHS for s in sizes}
    params = engine.init_params(jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.global_batch, a.seq + 1))
    compute = kernel_for(a.compute_ms)
    steps = {d: [] for d in DEPTHS}
    waits = {k: [] for k in probe_ts}
    for r in range(a.rounds + 1):  # round 0 warms up (compiles)
        for d in DEPTHS:
            engine.loop.transport = step_ts[d]
            wall = step_wall(engine, params, batch, world)
            for s in sizes:
                wait = exposed(world, probe_ts[d, s], compute, s)
                if r:
                    waits[d, s].append(wait)
            if r:
                steps[d].append(wall)
    if world.rank == 0:
        med = lambda v: float(np.median(v))  # noqa: E731
        out = {"ranks": p, "model": a.model, "tokens_per_microbatch": a.microbatch_size * a.seq,
               "message_bytes": int(np.prod(template.shape)) * np.dtype(template.dtype).itemsize, "rounds": a.rounds,
               "step_s": {f"depth{d}": med(v) for d, v in steps.items()},
               "step_ratio_depth0_over_depth2": med(steps[0]) / med(steps[2]),
               "exposed_ms": {f"depth{d} {s // 1024}KiB": round(1e3 * med(v), 3) for (d, s), v in waits.items()}}
        print(json.dumps(out), flush=True)
    for t in [*step_ts.values(), *probe_ts.values()]:  # one order on every rank (Comm.Free is collective)
        if t is not engine.transport:
            t.close()
    engine.close()


if __name__ == "__main__":
    main()
