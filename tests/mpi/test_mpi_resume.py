"""Resume of an MPI job (pipeline stages x data replicas, optionally a tensor mesh per rank) is bit-exact.

Run A trains 6 steps straight, checkpointing at 3 and 6. Run B starts from a copy of A's run directory
with every rank's step-6 checkpoint removed, as if the job had died after committing step 3, and
resumes through the CLI (``jaxhybrid launch ... --resume``). Steps 4-6 must log A's losses exactly, each
step once, and every rank's step-6 checkpoint (params, optimizer state, loss scale) must equal A's leaf
by leaf.
"""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_mpi_pipeline import ROOT, _env  # same env: MPIEXEC_TIMEOUT, 1 thread per rank

from jaxhybrid.model import PRESETS
from jaxhybrid.model.testing import assert_tree_close, without_key_bias
from jaxhybrid.runtime.checkpoint.store import read_state

pytestmark = pytest.mark.mpi


def _launch(n: int, devices: int, config: str, run_dir, *sets: str, resume: bool = False,
            flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``jaxhybrid launch -n n`` of a 6-step run (``n=0``: ``jaxhybrid train`` in this one process)."""
    args = [f"run.dir={run_dir}", "train.steps=6", "checkpoint.every=3", "train.log_every=1", "train.eval_every=3",
            *sets]
    launch = ["launch", "-n", str(n), "--timeout", "300", "--"] if n else ["train"]
    cmd = [sys.executable, "-m", "jaxhybrid", *launch, "--config", str(ROOT / "configs" / "runs" / config)]
    cmd += [a for kv in args for a in ("--set", kv)] + (["--resume"] if resume else []) + list(flags)
    r = subprocess.run(cmd, env=_env(300, devices), cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _losses(run_dir, key: str = "loss") -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [rec["step"] for rec in lines]
    assert steps == sorted(set(steps)), f"steps logged more than once or out of order: {steps}"
    return {rec["step"]: rec[key] for rec in lines if key in rec}


# The 2 x 2 grid with the host optimizer, its update fed chunk by chunk (2 buckets each) as the
# data-parallel all-reduce produces them (Myelin V-C, on by default here): run A of its resume test and the
# streamed side of test_streamed_allreduce_matches_reduce_then_update (one 4-rank job less). Tied
# embeddings, as every Myelin preset has: the last stage's copy of the table streams with its other
# gradients and is left out of its clip norm (the first stage counts it).
STREAMED_2X2 = ["optim.offload=true", "optim.bucket_size=20000", "optim.allreduce_coarsening=2",
                "model.tie_embeddings=true"]


@pytest.fixture(scope="session")  # session, as parity_job (tests/mpi/test_mpi_pipeline.py says why)
def streamed_2x2(tmp_path_factory):
    """``(run dir, finished launch)`` of the 6-step job with STREAMED_2X2."""
    run = tmp_path_factory.mktemp("streamed_2x2") / "a"
    return run, _launch(4, 1, "pipeline_2x2.yaml", run, *STREAMED_2X2)


@pytest.mark.parametrize("n,devices,config,sets", [
    # 2 stages, each on a (1, 1, 2) tensor mesh whose devices offload the optimizer state of their shards
    (2, 2, "hybrid.yaml", ["parallel.data=1", "optim.offload=true", "optim.bucket_size=20000"]),
    (4, 1, "pipeline_2x2.yaml", STREAMED_2X2),  # 2 x 2, host optimizer: run A is the streamed_2x2 fixture's
    # ZB-V: two stages per rank in the V, the tied table's two copies on rank 0, the offloaded optimizer over
    # both stages' parts; the export gathers every stage from the ranks' merged dicts
    (2, 1, "pipeline_2x2.yaml", ["parallel.data=1", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2",
                                 "pipeline.placement=v", "model.tie_embeddings=true", "optim.offload=true",
                                 "optim.bucket_size=20000"]),
    # ZeRO-1 on 2 x 2: each replica's host holds its shard of the masters and moments (the export puts the
    # shards together); the tied table's copies sit in different shards of the two stages
    (4, 1, "pipeline_2x2.yaml", ["optim.shard_optimizer=true", "optim.offload=true", "optim.bucket_size=20000",
                                 "model.tie_embeddings=true"]),
    # ZeRO-1 with AdamW on the device: each replica's checkpoint holds the moments of its shard
    (2, 1, "tiny.yaml", ["parallel.data=2", "optim.shard_optimizer=true"]),
    # The replicas' sum started during the phase (optim.overlap_grad_reduce), in buckets of 20000 elements
    (2, 1, "tiny.yaml", ["parallel.data=2", "optim.bucket_size=20000"]),
    # optim.allreduce_backend=xla: every rank joins one JAX distributed runtime, and each still writes and
    # restores its own checkpoint (orbax alone wrote only JAX process 0's) of its parameters sharded over a
    # local (1, 2, 1) tensor mesh; each column sums over one mesh of its replicas' local meshes
    (4, 2, "pipeline_2x2.yaml", ["optim.allreduce_backend=xla", "parallel.tensor_row=2"]),
    # ZeRO-1's reduce-scatter and all-gather as XLA collectives: each replica's checkpoint holds its shard
    (2, 1, "tiny.yaml", ["parallel.data=2", "optim.shard_optimizer=true", "optim.allreduce_backend=xla"]),
], ids=["hybrid-2x1-col2", "pipeline-2x2-offload", "zb-v-2x1-offload-tied", "pipeline-2x2-zero-offload",
        "data-1x2-zero", "data-1x2-overlapped", "pipeline-2x2-row2-xla", "data-1x2-zero-xla"])
def test_mpi_resume_is_bit_exact(request, tmp_path, n, devices, config, sets):
    a, b = tmp_path / "a", tmp_path / "b"
    if sets is STREAMED_2X2:
        a = request.getfixturevalue("streamed_2x2")[0]  # read only: the resume runs in a copy
    else:
        _launch(n, devices, config, a, *sets)
    _check_export(a, tmp_path / "export")
    if "optim.shard_optimizer=true" in sets:  # memory.json: each replica holds half the stage's Adam state
        report = json.loads((a / "memory.json").read_text())
        phi, half = report["params"], -(-report["params"] // 2)
        assert report["optimizer_shards"] == 2, report
        if report["offload"]:  # and half its masters, on the host
            assert report["host"] == {"params_master": 4 * half, "optimizer_state": 8 * half}, report
        else:
            assert report["device"]["optimizer_state"] == 8 * half and report["device"]["params_master"] == 4 * phi
    _check_resume(a, b, n, lambda: _launch(n, devices, config, b, *sets, resume=True))


def _check_export(run_dir, out) -> None:
    """``jaxhybrid export`` of the job's step 6 (stage slices, replicas, offloaded fp32 masters) is the
    trained model: on one device, in this process, it scores the validation loss the job logged there."""
    from jaxhybrid.model import Model
    from jaxhybrid.runtime.checkpoint.export import load_export
    from jaxhybrid.runtime.data.splits import validation_batches
    from jaxhybrid.runtime.run_dir import saved_config

    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "export", "--run-dir", str(run_dir), "--out", str(out)],
                       env=_env(300, 1), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "exported step 6" in r.stdout, (r.stdout + r.stderr)[-3000:]
    import jax

    cfg = saved_config(run_dir)
    model, params = Model(cfg.model, compute_dtype=cfg.precision.compute_dtype), load_export(out)
    loss = jax.jit(model.loss)  # one program for the 4 batches (eager: one per op, 3.3 s against 1.0 s)
    val = np.mean([float(loss(params, b[:, :-1], b[:, 1:])) for b in validation_batches(cfg)])
    assert_tree_close(np.float32(val), np.float32(_losses(run_dir, "val_loss")[6]), "fp32_parity", "val_loss ")


def test_streamed_allreduce_matches_reduce_then_update(tmp_path, streamed_2x2):
    """Myelin V-C in the trainer: on the 2 x 2 grid with the offloaded optimizer, the update fed chunk by
    chunk (2 buckets each) as the data-parallel all-reduce produces them logs the losses and writes the
    checkpoints of reducing every gradient first (the clip norm is summed per chunk there, per leaf here)."""
    on, streamed = streamed_2x2
    off = tmp_path / "off"
    reduced = _launch(4, 1, "pipeline_2x2.yaml", off, *STREAMED_2X2, "optim.stream_allreduce=false")
    # Both paths really ran: the trainer notes the clip's wait only when the engine streams reduced chunks
    # (Trainer.overlap_note; a grid that cannot stream notes that the update waits instead), and says
    # nothing of either with the stream off.
    note = "jaxhybrid: note: optim.grad_clip=1.0: the global norm needs every reduced chunk"
    assert note in streamed.stdout + streamed.stderr, (streamed.stdout + streamed.stderr)[-3000:]
    assert "jaxhybrid: note: optim." not in reduced.stdout + reduced.stderr, (reduced.stdout + reduced.stderr)[-3000:]
    lon, loff = _losses(on), _losses(off)
    assert sorted(lon) == sorted(loff) == [1, 2, 3, 4, 5, 6]
    assert_tree_close([lon[s] for s in sorted(lon)], [loff[s] for s in sorted(loff)], "fp32_parity", "losses ")
    # The clip norm counts the tied table once on both paths (a double count below the clip leaves no
    # other trace).
    gon, goff = _losses(on, "grad_norm"), _losses(off, "grad_norm")
    assert_tree_close([gon[s] for s in sorted(gon)], [goff[s] for s in sorted(goff)], "fp32_parity", "grad norms ")
    von, voff = _losses(on, "val_loss"), _losses(off, "val_loss")
    assert sorted(von) == sorted(voff) == [3, 6], (von, voff)
    assert_tree_close(von, voff, "fp32_parity", "val losses ")
    ranks = sorted(p.name for p in (on / "checkpoints").iterdir())
    assert ranks == [f"rank_{r}" for r in range(4)], ranks
    for rank in ranks:
        for step in ("3", "6"):
            got, want = (_without_key_bias(read_state(r / "checkpoints" / rank / step / "state")) for r in (on, off))
            assert_tree_close(got, want, "fp32_parity", f"{rank} step-{step} checkpoint, streamed vs not ")
    # The tied table's fp32 masters: the first stage's and the last stage's copy, in every replica, the
    # same bits after 6 streamed updates (each reduced at its own offset in its stage's chunks).
    tables = {rank: _tied_master(read_state(on / "checkpoints" / rank / "6" / "state")) for rank in ranks}
    assert len({t.tobytes() for t in tables.values()}) == 1, {r: t.ravel()[:3] for r, t in tables.items()}


def _tied_master(state) -> np.ndarray:
    """The offloaded fp32 master of a stage's tied table: ``embed.wte`` (first stage) or its copy (last)."""
    from jaxhybrid.model.transformer import TIED_KEY
    from jaxhybrid.parallel.data.flat import FlatSpec

    spec = FlatSpec(state["params"])
    i = spec.paths.index("['embed']['wte']" if "embed" in state["params"] else f"['{TIED_KEY}']")
    return np.asarray(state["opt_state"]["master"])[spec.offsets[i]:spec.offsets[i] + spec.sizes[i]]


def _check_resume(a, b, n: int, resume) -> None:
    """Copy run ``a`` to ``b`` without its step-6 checkpoints, run ``resume()`` and compare with ``a``."""
    shutil.copytree(a, b)
    ranks = sorted((b / "checkpoints").iterdir())
    assert len(ranks) == n, ranks
    for rank in ranks:
        assert sorted(p.name for p in rank.iterdir() if p.name.isdigit()) == ["3", "6"]
        shutil.rmtree(rank / "6")
    out = resume().stdout
    assert "step 4/6" in out and "step 3/6" not in out, out[-2000:]  # it resumed at 3, it did not restart
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4, 5, 6]
    assert [lb[s] for s in (4, 5, 6)] == [la[s] for s in (4, 5, 6)], (la, lb)
    assert np.isfinite(lb[6])
    va, vb = _losses(a, "val_loss"), _losses(b, "val_loss")  # validation with the resumed parameters
    assert sorted(va) == [3, 6] and va == vb, (va, vb)
    for rank in ranks:
        got = read_state(b / "checkpoints" / rank.name / "6" / "state")
        want = read_state(a / "checkpoints" / rank.name / "6" / "state")
        assert_tree_close(got, want, "exact", f"{rank.name} step-6 checkpoint after resume ")


def _without_key_bias(state):
    """A checkpoint of tiny.yaml's or pipeline_2x2.yaml's model (gpt-tiny) without its qkv biases' key part
    (:func:`jaxhybrid.model.testing.without_key_bias` says why)."""
    return {"params": without_key_bias(state["params"], PRESETS["gpt-tiny"]),
            **{k: v for k, v in state.items() if k != "params"}}


@pytest.mark.parametrize("devices,data,offload", [(4, 2, False), (2, 1, True)],
                         ids=["data-across-processes", "row-across-processes-offload"])
def test_distributed_tensor_mode_matches_one_process_and_resumes(tmp_path, devices, data, offload):
    """``--distributed``: a (data, row 2, col 2) mesh over two processes (JAX's distributed runtime, peers
    found from the MPI launcher, gloo collectives) logs the same losses as the one-process run on all the
    devices and writes the same checkpoint; then it resumes bit-exactly from step 3. With data=2 each
    process holds whole replicas; with data=1 the row axis spans the processes, so no process holds any
    sharded parameter whole (orbax writes each process's shards), and each device offloads the optimizer
    state of the shards it owns to its process's host memory; one process with the same mesh then resumes
    that checkpoint too (see _resume_in_one_process)."""
    # Adam's eps 1e-6, not 1e-8: an element whose gradient is near zero gets an update of about lr * g / |g|, so
    # the gloo reduction's summation order moved one mlp_up weight by 1.2e-5 relative once the warm-up's first
    # step trained; with 1e-6 every leaf agrees to 1.3e-6 (tensor parity and sharded offload do the same).
    sets = [f"parallel.data={data}", "parallel.tensor_row=2", "parallel.tensor_col=2", "model.n_layers=2",
            "optim.eps=1e-6"]
    sets += ["optim.offload=true", "optim.bucket_size=20000"] if offload else []
    one, a, b = tmp_path / "one", tmp_path / "a", tmp_path / "b"
    _launch(0, 2 * devices, "tiny.yaml", one, *sets)
    _launch(2, devices, "tiny.yaml", a, *sets, flags=("--distributed",))
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["rank_0"]  # one mesh: one checkpoint
    lo, la = _losses(one), _losses(a)
    assert sorted(la) == [1, 2, 3, 4, 5, 6]
    assert_tree_close([la[s] for s in sorted(la)], [lo[s] for s in sorted(lo)], "fp32_parity", "losses ")
    got, want = (_without_key_bias(read_state(r / "checkpoints" / "rank_0" / "6" / "state")) for r in (a, one))
    if offload:  # the host state is saved per leaf across processes, as flat vectors by one process; the
        got, want = got["params"], want["params"]  # updates it made are in the params (and resume checks it)
    assert_tree_close(got, want, "fp32_parity", "step-6 checkpoint, 2 processes vs 1 ")
    _check_resume(a, b, 1, lambda: _launch(2, devices, "tiny.yaml", b, *sets, resume=True, flags=("--distributed",)))
    if offload:
        _resume_in_one_process(a, tmp_path / "c", 2 * devices, sets)


def _resume_in_one_process(a, c, devices: int, sets) -> None:
    """A copy of the ``--distributed`` run ``a`` without its step-6 checkpoint, resumed by ONE process on
    the same mesh: orbax must not stop at "Topology mismatch" (the compute params sharded over two
    processes) or at the tree structure of the host state (saved per leaf across processes), and the
    run must continue from a's step 3, optimizer state included: steps 4-6 log a's losses and end at a's
    parameters (fp32_parity: one process reduces in another order than gloo). A fresh optimizer state
    (Adam's moments and step count from zero) moves the step-6 parameters far beyond that."""
    shutil.copytree(a, c)
    shutil.rmtree(c / "checkpoints" / "rank_0" / "6")
    out = _launch(0, devices, "tiny.yaml", c, *sets, resume=True).stdout
    la, lc = _losses(a), _losses(c)
    assert sorted(lc) == [1, 2, 3, 4, 5, 6], (lc, out[-2000:])
    assert [lc[s] for s in (1, 2, 3)] == [la[s] for s in (1, 2, 3)]  # kept from a, not run again
    assert_tree_close([lc[s] for s in (4, 5, 6)], [la[s] for s in (4, 5, 6)], "fp32_parity", "one-process resume losses ")
    got, want = (_without_key_bias(read_state(r / "checkpoints" / "rank_0" / "6" / "state"))["params"] for r in (c, a))
    assert_tree_close(got, want, "fp32_parity", "step-6 params, resumed by one process vs the 2-process run ")


def test_distributed_run_starts_from_an_export(tmp_path):
    """``train.init_from`` under ``--distributed``: each process reads the export onto a device of its own
    (``jax.devices()[0]`` is process 0's, which process 1 cannot fill: it failed with "no addressable
    shards" while process 0 hung in orbax's barrier), and the mesh's first loss is the exported weights'
    loss on the first batch."""
    from jaxhybrid.model import Model
    from jaxhybrid.runtime.checkpoint.export import load_export
    from jaxhybrid.runtime.data import Sampler
    from jaxhybrid.runtime.data.splits import open_dataset
    from jaxhybrid.runtime.run_dir import saved_config

    small = ["model.n_layers=2", "train.eval_every=0", "train.steps=2", "checkpoint.every=0"]
    src, out, b = tmp_path / "src", tmp_path / "w", tmp_path / "b"
    _launch(0, 1, "tiny.yaml", src, *small)
    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "export", "--run-dir", str(src), "--out", str(out)],
                       env=_env(300, 1), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    _launch(2, 4, "tiny.yaml", b, *small, "train.steps=1", "parallel.data=2", "parallel.tensor_row=2",
            "parallel.tensor_col=2", f"train.init_from={out}", flags=("--distributed",))
    cfg = saved_config(src)
    batch = Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed).batch(0)
    want = Model(cfg.model).loss(load_export(out), batch[:, :-1], batch[:, 1:])
    assert_tree_close(np.float32(_losses(b)[1]), np.float32(want), "fp32_parity", "first loss from the export ")
