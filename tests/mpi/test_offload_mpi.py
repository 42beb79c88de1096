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
def test_half_precision_allreduce_under_mpirun_3():
    """``optim.allreduce_dtype: compute`` (Myelin IV-B) on three ranks: the half-precision sums are exactly
    the float32 rank-order sums rounded once, whatever an element's offset, and a pipeline engine built
    with it reduces through them, whole and streamed (tests/mpi/drive_half_allreduce.py)."""
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "3", sys.executable, "-m", "mpi4py",
           str(ROOT / "tests/mpi/drive_half_allreduce.py")]
    out = subprocess.run(cmd, env=_env(150), cwd=ROOT, capture_output=True, text=True, timeout=170)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for case in ("half-sum", "engine"):
        assert f"CASE {case} ok" in out.stdout, text[-4000:]
