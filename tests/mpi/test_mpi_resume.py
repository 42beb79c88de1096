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
import orbax.checkpoint as ocp
import pytest

from jaxhybrid.testing import assert_tree_close
from test_mpi_pipeline import ROOT, _env  # same env: MPIEXEC_TIMEOUT, 1 thread per rank

pytestmark = pytest.mark.mpi


def _launch(n: int, devices: int, config: str, run_dir, *sets: str, resume: bool = False) -> str:
    args = [f"run.dir={run_dir}", "train.steps=6", "checkpoint.every=3", "train.log_every=1", *sets]
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", str(n), "--timeout", "300", "--",
           "--config", str(ROOT / "configs" / "runs" / config)]
    cmd += [a for kv in args for a in ("--set", kv)] + (["--resume"] if resume else [])
    r = subprocess.run(cmd, env=_env(300, devices), cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def _losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [rec["step"] for rec in lines]
    assert steps == sorted(set(steps)), f"steps logged more than once or out of order: {steps}"
    return {rec["step"]: rec["loss"] for rec in lines}


@pytest.mark.parametrize("n,devices,config,sets", [
    (2, 2, "hybrid.yaml", ["parallel.data=1"]),  # 2 stages, each on a (1, 1, 2) tensor mesh
    (4, 1, "pipeline_2x2.yaml", ["optim.offload=true", "optim.bucket_size=20000"]),  # 2 x 2, host optimizer
], ids=["hybrid-2x1-col2", "pipeline-2x2-offload"])
def test_mpi_resume_is_bit_exact(tmp_path, n, devices, config, sets):
    a, b = tmp_path / "a", tmp_path / "b"
    _launch(n, devices, config, a, *sets)
    shutil.copytree(a, b)
    ranks = sorted((b / "checkpoints").iterdir())
    assert len(ranks) == n, ranks
    for rank in ranks:
        assert sorted(p.name for p in rank.iterdir() if p.name.isdigit()) == ["3", "6"]
        shutil.rmtree(rank / "6")
    out = _launch(n, devices, config, b, *sets, resume=True)
    assert "step 4/6" in out and "step 3/6" not in out, out[-2000:]  # it resumed at 3, it did not restart
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4, 5, 6]
    assert [lb[s] for s in (4, 5, 6)] == [la[s] for s in (4, 5, 6)], (la, lb)
    assert np.isfinite(lb[6])
    for rank in ranks:
        got = ocp.StandardCheckpointer().restore(b / "checkpoints" / rank.name / "6" / "state")
        want = ocp.StandardCheckpointer().restore(a / "checkpoints" / rank.name / "6" / "state")
        assert_tree_close(got, want, "exact", f"{rank.name} step-6 checkpoint after resume ")
