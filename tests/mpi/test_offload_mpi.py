"""Offloaded optimizer under mpirun -n 2: G_data = 2 with chunk-fed overlap, and a 2-stage pipeline; the
data-parallel ``allreduce_tree``'s dtype rules."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi_pipeline import _env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.mpi
def test_offload_bit_exact_under_mpirun():
    env = _env(150)  # the MPI tests' own: MPIEXEC_TIMEOUT, 1 thread per rank, XLA flags
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "2", sys.executable, "-m", "mpi4py",
           str(ROOT / "tests/mpi/drive_offload.py")]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=170)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for case in ("data-k1", "data-k2", "pipeline-2stage", "pipeline-2stage-bf16", "allreduce-tree"):
        assert f"CASE {case} ok" in out.stdout, text[-4000:]


@pytest.mark.mpi
def test_half_precision_ring_allreduce_under_mpirun_3():
    """``optim.allreduce_dtype: compute`` (Myelin IV-B): on three ranks the ring's half-precision sums are
    exactly a numpy replay of its order, the same bits on every rank, within p - 1 roundings of float32."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "3", sys.executable, "-m", "mpi4py",
           str(ROOT / "tests/mpi/drive_ring.py")]
    out = subprocess.run(cmd, env=_env(150), cwd=ROOT, capture_output=True, text=True, timeout=170)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "CASE ring ok" in out.stdout, text[-4000:]


@pytest.mark.mpi
def test_trainer_all_reduces_bf16_as_bf16_over_three_replicas(tmp_path):
    """The trainer's wiring of ``optim.allreduce_dtype: compute``: three bf16 replicas with the offloaded
    optimizer train as with the float32 wire within bf16 rounding, and not to the same bits (the ring ran:
    with three replicas it rounds each sum twice, the float32 wire once)."""
    import json

    import numpy as np

    from jaxhybrid.checkpoint import read_state
    from jaxhybrid.testing import assert_tree_close

    def run(dtype):
        sets = ["parallel.pipeline=1", "parallel.data=3", "train.global_batch=6", "pipeline.microbatches=2",
                "precision.compute_dtype=bfloat16", "optim.offload=true", "optim.bucket_size=20000",
                f"optim.allreduce_dtype={dtype}", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                "data.seq_len=64", "metrics.trace=false", "metrics.plot=false", "metrics.tensorboard=false",
                f"run.dir={tmp_path / dtype}"]
        cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "3", "--timeout", "150", "--config",
               str(ROOT / "configs" / "runs" / "tiny.yaml"), *[a for kv in sets for a in ("--set", kv)]]
        r = subprocess.run(cmd, env=_env(150), cwd=ROOT, capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        lines = (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()
        state = read_state(tmp_path / dtype / "checkpoints" / "rank_0" / "3" / "state")
        return [json.loads(x)["loss"] for x in lines], state["opt_state"]["master"]

    (half, m_half), (f32, m_f32) = run("compute"), run("float32")
    assert len(half) == len(f32) == 3 and half[0] == f32[0]  # the first loss is before any reduction
    assert_tree_close(np.float32(half), np.float32(f32), "bf16_parity", "losses, bf16 vs float32 wire ")
    assert_tree_close(m_half, m_f32, "bf16_parity", "fp32 masters after 3 steps ")
    assert not np.array_equal(m_half, m_f32), "the bf16 ring and the float32 wire gave the same bits"
