"""MPI driver (run by tests/mpi/test_mpi_pipeline.py under ``mpirun -n P*D python -m mpi4py``).

For each grid ``(G_inter, G_data)`` of its command line (several grids of the same world size run in
sequence in one job, sharing each rank's start-up and the single-device references) it loops over the
grid's (schedule x 2BP x transport) cases, reusing each rank's compiled stage, and checks the trainer's
step (engine -> global grad stats -> AdamW) for 3 steps against the single-device LocalEngine run on the
same global batches: every step's loss and the parameters after 3 steps, leaf by leaf, within
TOLERANCES["fp32_parity"]. With ``--bad-input`` it first checks that bad layouts are refused with the same
message on every rank.
Rank 0 prints one ``CASE grid=PxD TOKEN: ok|FAIL ...`` line per case (TOKEN as given in ``--cases``) and a
``SUMMARY`` per grid; the exit code is 1 if any case failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxhybrid.cli.commands.train import enable_compilation_cache
from jaxhybrid.model import Model
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim import device_updater
from jaxhybrid.runtime.engines.build import build_updater
from jaxhybrid.parallel.pipeline.topology import Topology
from jaxhybrid.planner.plan import load_plan_overrides
from jaxhybrid.parallel.pipeline.transport import Envelope, MsgKind, wait_message
from jaxhybrid.runtime import distributed
from jaxhybrid.runtime.config_load import config_from_dict
from jaxhybrid.runtime.engines.base import LocalEngine
from jaxhybrid.runtime.engines.pipeline import PipelineEngine, make_transport

# Every case uses microbatches of MB sequences, so all schedules share one set of compiled stage kernels
# (1F1B-1's M = P then means a smaller global batch, with its own single-device reference).
STEPS, SEQ, MB = 3, 8, 2
WORLD = MPI.COMM_WORLD


TENSOR: dict = {}  # hybrid pipeline x tensor: parallel.tensor_* and tensor.optimizations of every case


def make_cfg(p, d, schedule, m, split, transport="mpi4jax", tied=False, kind="gpt2", **extra):
    model = {"name": "gpt-tiny" if kind == "gpt2" else "llama-tiny", "kind": kind, "vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 2,
             "d_ff": 64, "max_seq_len": 16, "tie_embeddings": tied}
    if kind == "llama":
        model["n_kv_heads"] = 2
    tree = {"model": model,
            "data": {"seq_len": SEQ}, "train": {"steps": STEPS, "global_batch": MB * m * d},
            # eps=1e-3: Adam divides by sqrt(v); on gradients that are zero in exact arithmetic (the key
            # bias: softmax ignores it) float noise of 1e-9 would become a full +-lr step, on either side.
            "optim": {"warmup_steps": 1, "grad_clip": 1.0, "bucket_size": 1000, "eps": 1e-3},
            "parallel": {"pipeline": p, "data": d},
            "pipeline": {"schedule": schedule, "microbatches": m, "split_backward": split, "transport": transport,
                         "watchdog_s": 60.0}}
    for k, v in {**TENSOR, **extra}.items():
        tree.setdefault(k.split(".")[0], {})[k.split(".")[1]] = v
    return config_from_dict(tree)


def batches(cfg):
    rng = np.random.default_rng(1)
    return [rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, SEQ + 1)).astype(np.int32)
            for _ in range(STEPS)]


_UPDATERS: dict = {}


def train(engine, cfg, data):
    """The trainer's step (jaxhybrid.runtime.trainer.Trainer.step) without data loading and writers. Returns the
    losses, the first step's gradients, the parameters after the last step and their validation loss
    (``eval_loss``) on the first batch."""
    key = (cfg.optim, cfg.train.steps)
    if cfg.optim.shard_optimizer or cfg.optim.offload:  # the trainer's, built on this engine's stage and column
        updater = build_updater(cfg, engine)
    else:  # one compiled optimizer per configuration, shared by the cases
        if key not in _UPDATERS:
            _UPDATERS[key] = device_updater(cfg)
        updater = _UPDATERS[key]
    params = engine.init_params(jax.random.key(cfg.train.seed))
    state = updater.init(params)
    params = updater.compute_params(params)
    losses, first, val = [], None, None
    for b in data:
        if updater.reduces_over_replicas:  # ZeRO-1, as Trainer.step: its step-1 gradients are shards, unchecked
            loss, grads = engine.loss_and_local_grads(params, b, 1.0)
            params, state, _, _ = updater.apply_local(params, state, grads, 1.0, engine.global_sum, engine.global_max,
                                                      engine.norm_view)
            losses.append(float(loss))
            continue
        loss, grads = engine.loss_and_grads(params, b, 1.0)
        first = jax.tree.map(np.asarray, grads) if first is None else first
        sq, nonfinite = updater.stats(engine.norm_view(grads))  # as Trainer.step: tied copies counted once
        sq, nonfinite = engine.global_sum(sq), engine.global_max(nonfinite)
        params, state, _ = updater.apply(params, state, grads, 1.0, sq, nonfinite)
        losses.append(float(loss))
    val = float(engine.eval_loss(params, data[0]))  # forward-only pipeline pass with the trained params
    return losses, first, jax.tree.map(np.asarray, params), val


def quiet_barrier(comm) -> None:
    """A barrier whose waiting ranks sleep: mpich's blocking calls spin (sched_yield), and with more
    ranks than cores the spinners take half of the one rank that computes."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(2e-3)


def reference(cfg, data):
    """Single device, computed on rank 0 and broadcast (other ranks skip its compilation)."""
    out = None
    if WORLD.rank == 0:  # AdamW on the device, whatever optimizer the case's layout runs
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, shard_optimizer=False, offload=False))
        try:
            out = train(LocalEngine(Model(cfg.model)), cfg, data)
        except Exception as e:  # noqa: BLE001 (every rank raises it: the others would wait in the barrier)
            out = RuntimeError(f"the single-device reference failed on rank 0: {type(e).__name__}: {e}")
    quiet_barrier(WORLD)
    out = WORLD.bcast(out, root=0)
    if isinstance(out, Exception):
        raise out
    return out


def same_on_all_ranks(fn) -> str:
    """Run ``fn`` expecting ValueError on every rank; return the message after checking all agree."""
    try:
        fn()
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    msgs = WORLD.allgather(msg)
    if len(set(msgs)) != 1 or msg == "no error":
        raise AssertionError(f"bad input not refused identically: {msgs}")
    return msg


def bad_input_checks(p, d):
    n = WORLD.size
    m1 = same_on_all_ranks(lambda: Topology.from_config(make_cfg(p + 1, d, "1f1b", 2 * (p + 1), False)))
    m2 = same_on_all_ranks(lambda: make_cfg(5, 1, "naive", 1, False))
    topo = Topology.from_config(make_cfg(p, d, "1f1b", 2 * p, False))
    cfg = make_cfg(p, d, "1f1b", 1, True)  # valid for 1f1b; zb-h1 with 1 microbatch < p stages is not
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule="zb-h1"))
    m3 = same_on_all_ranks(lambda: PipelineEngine(cfg, Model(cfg.model), topo, abort_on_error=False))
    for m, want in ((m1, f"!= world size {n}"), (m2, "exceed model.n_layers=4"), (m3, "zb-h1")):
        if want not in m:
            raise AssertionError(f"expected {want!r} in {m!r}")
    if WORLD.rank == 0:
        print(f"BADINPUT ok: {m1} | {m2} | {m3}", flush=True)


def bf16_round_trip(topo):
    """Every transport moves bfloat16 bit-exactly between the first two stages (the MPI ones as uint16, the
    transfer server as it is), and the mpi4jax transport's jitted receive holds no arithmetic (the bitcast
    runs apart)."""
    template = jax.ShapeDtypeStruct((3, 5, 7), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(topo.rank), template.shape, jnp.bfloat16)
    for name in ("mpi4jax", "mpi4py", "transfer"):
        t = make_transport(name, topo.p2p, template)
        if topo.stage in (0, 1) and topo.num_stages > 1:
            peer = 1 - topo.stage
            t.send(x, peer, Envelope(MsgKind.ACT if topo.stage == 0 else MsgKind.GRAD, 3, peer))
            msg = wait_message(t)
            want = jax.random.normal(jax.random.key(topo.dims.rank(peer, topo.replica)), template.shape, jnp.bfloat16)
            assert msg.payload.dtype == jnp.bfloat16, msg.payload.dtype
            assert np.array_equal(np.asarray(msg.payload).view(np.uint16), np.asarray(want).view(np.uint16)), name
            assert msg.envelope.microbatch == 3 and msg.envelope.stage == topo.stage, msg.envelope
            t.flush()
            if name == "mpi4jax":  # the receive runs inline, never on XLA:CPU's worker pool (mpi_transport)
                flops = t.recv_flops(peer)
                assert flops < 1000, f"the mpi4jax receive program counts {flops} flops"
        # The transfer server's pulls complete asynchronously: a peer that closed its transport (dropping the
        # server) before this rank's pull landed would fail it ("Transport endpoint is not connected").
        quiet_barrier(WORLD)
        t.close()
    if WORLD.rank == 0:
        print("BF16 ok: the mpi4jax, mpi4py and transfer transports are bit-exact", flush=True)


CHUNKS = {"v2": (2, "loop"), "vee": (2, "v"), "alloc": "alloc"}  # two stages per rank (interleaved, a V) or --plan's
PLAN: dict = {}  # the stage map, partition and pattern of --plan's allocation (`jaxhybrid partition --out`)


def parse_case(token: str) -> tuple:
    """``schedule[:2bp][:mpi4py|:xfer][:tied][:llama][:v2|:vee][:zero][:offload][:after][:LETTERS]`` -> (schedule, 2bp,
    transport, tied, model kind, tensor optimizations, (virtual stages, placement), optim keys); the defaults
    are fused backward, mpi4jax, untied, GPT-2, one stage per rank, ABCDE and AdamW on the device (``v2``: two
    stages per rank, loop placement; ``vee``: the V; ``alloc``: ``--plan``'s MadPipe allocation; ``zero``:
    optim.shard_optimizer; ``offload``: optim.offload; ``xfer``: pipeline.transport=transfer; ``after``: optim.overlap_grad_reduce off, the replicas'
    sum after the pipeline phase)."""
    name, *opts = token.split(":")
    bad = [o for o in opts if o not in ("2bp", "mpi4py", "xfer", "tied", "llama", "zero", "offload", "after", *CHUNKS)
           and not o.isupper()]
    if bad or (name in ("zb-h1", "zb-v") and "2bp" not in opts):  # the zero-bubble schedules always split
        raise SystemExit(f"drive_parity.py: bad case {token!r}")
    letters = next((o for o in opts if o.isupper()), "ABCDE")
    chunks = next((CHUNKS[o] for o in opts if o in CHUNKS), (1, "loop"))
    optim = {"optim.shard_optimizer": "zero" in opts, "optim.offload": "offload" in opts,
             "optim.overlap_grad_reduce": "after" not in opts}
    transport = "mpi4py" if "mpi4py" in opts else "transfer" if "xfer" in opts else "mpi4jax"
    return (name, "2bp" in opts, transport, "tied" in opts,
            "llama" if "llama" in opts else "gpt2", letters, chunks, optim)


def grid_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="drive_parity.py", description="one grid's cases; grids are separated "
                                 "by --then and run in order in the same job")
    ap.add_argument("--pipeline", type=int, required=True)
    ap.add_argument("--data", type=int, required=True)
    ap.add_argument("--cases", required=True, help="comma-separated schedule[:2bp][:mpi4py][:tied][:llama]"
                    "[:LETTERS] (LETTERS: tensor.optimizations), e.g. naive,zb-h1:2bp,myelin:2bp:mpi4py")
    ap.add_argument("--tensor", default="", help="D,R,C: hybrid layout, every rank a local (depth, row, col) "
                    "mesh (the launcher gives each rank D*R*C devices)")
    ap.add_argument("--plan", default="", help="an allocation plan file (jaxhybrid partition --out) that the "
                    "cases marked :alloc train")
    ap.add_argument("--allreduce-backend", choices=("mpi", "xla"), default="mpi",
                    help="optim.allreduce_backend of the grid's cases (xla: the job joins jax.distributed at start)")
    ap.add_argument("--bad-input", action="store_true")
    ap.add_argument("--trace", action="store_true", help="write and check a merged trace of the 1f1b:2bp case")
    return ap


def run_grid(a, refs: dict) -> int:
    """One grid's cases on this job's ranks; ``refs`` (the single-device references) is shared by the
    grids, whose global batches coincide. Returns the number of failed cases (on every rank)."""
    p, d = a.pipeline, a.data
    TENSOR.clear()
    if a.tensor:
        dp, rw, cl = (int(v) for v in a.tensor.split(","))
        TENSOR.update({"parallel.tensor_depth": dp, "parallel.tensor_row": rw, "parallel.tensor_col": cl})
    if a.bad_input:
        bad_input_checks(p, d)
    tokens = [t for t in a.cases.split(",") if t]
    cases = [parse_case(t) for t in tokens]
    if a.plan:
        over = load_plan_overrides(a.plan)
        PLAN.update({"parallel.partition": over["parallel"]["partition"],
                     "pipeline.stage_to_rank": over["pipeline"]["stage_to_rank"],
                     "pipeline.pattern": over["pipeline"]["pattern"]})
    topos = {(1, "loop"): Topology.from_config(make_cfg(p, d, "1f1b", 2 * p, False))}
    if a.bad_input:
        bf16_round_trip(topos[1, "loop"])
    engines, failures = {}, 0
    for token, (name, split, transport, tied, kind, letters, chunks, optim) in zip(tokens, cases):
        m = p if name == "1f1b-1" else 2 * p
        placed = ({k: v for k, v in PLAN.items() if name == "periodic" or k != "pipeline.pattern"} if chunks == "alloc"
                  else {"pipeline.virtual_stages": chunks[0], "pipeline.placement": chunks[1]})
        cfg = make_cfg(p, d, name, m, split, transport, tied, kind,
                       **{"tensor.optimizations": letters, "optim.allreduce_backend": a.allreduce_backend}, **placed,
                       **optim)
        if chunks not in topos:  # every rank runs the cases in one order: the collective splits match
            topos[chunks] = Topology.from_config(cfg)
        topo = topos[chunks]
        traced = a.trace and name == "1f1b" and split
        status = "ok"
        t0 = time.perf_counter()
        try:
            rkey = (tied, kind, cfg.train.global_batch)
            if rkey not in refs:
                refs[rkey] = reference(cfg, batches(cfg))
            ref_losses, ref_grads, ref_params, ref_val = refs[rkey]
            key = (transport, tied, kind, letters, chunks)
            if key not in engines:  # later cases switch schedules on it: kernels compile once per shape
                engines[key] = PipelineEngine(cfg, Model(cfg.model), topo)
            engine = engines[key]
            engine.set_schedule(name, split, microbatches=m)
            engine.time_tasks(traced)  # the traced case: kernel times (synced)
            losses, grads, params, val = train(engine, cfg, batches(cfg))
            what = f"[{p}x{d} {token} rank {topo.rank}]"
            if a.tensor:  # the stage really runs sharded: every kernel is split over the whole local mesh
                flat = jax.tree_util.tree_flatten_with_path(engine.init_params(jax.random.key(0)))[0]
                kernels = [x for path, x in flat if "kernel" in jax.tree_util.keystr(path)]
                ways = {x.size // x.addressable_shards[0].data.size for x in kernels}
                assert ways == {cfg.tensor_size}, f"{what} kernels split {ways} ways, want {cfg.tensor_size}"
                if engine.xla_column is not None:  # the column's sum spans the replicas' local meshes
                    shape = engine.xla_column.tensor_mesh.devices.shape
                    assert shape == (d, *TENSOR.values()), f"{what} column mesh {shape}"
            assert_tree_close(np.array(losses), np.array(ref_losses), "fp32_parity", what + " losses")
            # slice_params of the reference gives the tied copy the whole table's gradient (both uses).
            mine = engine.slice_params
            if grads is not None:
                assert_tree_close(grads, mine(ref_grads), "fp32_parity", what + " step-1 grads")
            assert_tree_close(params, mine(ref_params), "fp32_parity", what + " params")
            assert_tree_close(np.float32(val), np.float32(ref_val), "fp32_parity", what + " eval loss")
            if traced:
                with tempfile.TemporaryDirectory() as tmp:
                    info = engine.write_trace(tmp)
                    if topo.rank == 0:
                        files = sorted(os.listdir(tmp))
                        assert files == ["trace.json", "trace.png"], files
                        print(f"TRACE grid={p}x{d} bubble_ratio={info['bubble_ratio']:.3f} "
                              f"makespan_s={info['makespan_s']:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001 (reported per case, job continues)
            status = f"FAIL {type(e).__name__}: {e}"
            traceback.print_exc()
        statuses = WORLD.gather(status, root=0)
        bad = [s for s in (statuses or []) if s != "ok"]
        failures += bool(bad) if WORLD.rank == 0 else 0
        if WORLD.rank == 0:
            print(f"CASE grid={p}x{d} {token}: {'ok' if not bad else bad[0]} ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    for e in engines.values():
        e.close()
    failures = WORLD.bcast(failures, root=0)
    if WORLD.rank == 0:
        print(f"SUMMARY grid={p}x{d} cases={len(cases)} failures={failures}", flush=True)
    return failures


def main(argv: list[str]) -> int:
    """Every grid of the command line (groups of flags separated by ``--then``) in one job: one start-up
    and JAX init per rank, one persistent-cache lookup per program, one reference per global batch."""
    groups, cur = [], []
    for tok in argv:
        if tok == "--then":
            groups.append(cur)
            cur = []
        else:
            cur.append(tok)
    groups.append(cur)
    grids = [grid_parser().parse_args(g) for g in groups]
    if any(a.allreduce_backend == "xla" for a in grids):  # before any JAX computation, as `jaxhybrid train`
        distributed.initialize()
        jax.devices()  # the backend starts collectively: every process now, not rank 0 alone in reference()
    # The session's persistent compilation cache (tests/conftest.py): the grids share programs.
    enable_compilation_cache("auto")
    refs, failures = {}, 0
    for a in grids:
        if a.pipeline * a.data != WORLD.size:
            raise SystemExit(f"drive_parity.py: grid {a.pipeline}x{a.data} needs {a.pipeline * a.data} ranks, "
                             f"the job has {WORLD.size}")
        failures += run_grid(a, refs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
