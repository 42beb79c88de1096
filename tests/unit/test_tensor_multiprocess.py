"""Two CPU processes form one 8-device mesh through jax.distributed (gloo) and match the single device."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two fresh JAX processes compiling on 2 cores: about 40 s of CPU
def test_two_processes_one_mesh(shape="2,1,2,2"):
    """data=2 spans the two processes (process-major device order); row x col stay inside each."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "jaxhybrid.tensor.distributed", "--port", str(port), "--shape", shape,
           "--num-processes", "2", "--local-devices", "4"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: loss" in out and "matches the single-device step" in out


def test_distributed_peers_and_layout_are_checked_before_any_process_waits():
    """``jaxhybrid train --distributed``: where the peers come from, and the errors for a bad launch or a
    layout that is not one tensor-mode mesh (all raised before the distributed runtime starts)."""
    import argparse

    from jaxhybrid.commands import train as train_cmd
    from jaxhybrid.config import ConfigError, load_config
    from jaxhybrid.tensor.distributed import peer_arguments

    assert peer_arguments("node0:1234", 4, 3) == {"coordinator_address": "node0:1234", "num_processes": 4,
                                                 "process_id": 3}
    assert peer_arguments(env={"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}) == {}  # JAX reads Slurm itself
    with pytest.raises(ValueError, match="missing --num-processes, --process-id"):
        peer_arguments("node0:1234")
    with pytest.raises(ValueError, match="'node0' must be HOST:PORT"):
        peer_arguments("node0", 2, 0)
    with pytest.raises(ValueError, match=r"--process-id 2 must be in \[0, --num-processes 2\)"):
        peer_arguments("node0:1", 2, 2)
    with pytest.raises(ValueError, match="found no launcher"):
        peer_arguments(env={})
    from jaxhybrid.tensor.distributed import initialize

    with pytest.raises(ValueError, match=r"over 3 processes: the mesh's 8 devices .* do not split evenly"):
        initialize("localhost:1", 3, 0, mesh_devices=8)  # raised before the runtime starts: no peer waits

    p = argparse.ArgumentParser()
    train_cmd.add_arguments(p)
    mesh = load_config(None, ["parallel.tensor_col=2"], check=False)
    train_cmd.check_distributed(mesh, p.parse_args(["--distributed"]))  # one tensor mesh: accepted
    with pytest.raises(ConfigError, match=r"needs parallel.pipeline=1 and a tensor grid or parallel.mesh_data=true, got pipeline=2"):
        train_cmd.check_distributed(load_config(None, ["parallel.pipeline=2"], check=False),
                                    p.parse_args(["--distributed"]))
    with pytest.raises(ConfigError, match="only apply with --distributed"):
        train_cmd.check_distributed(mesh, p.parse_args(["--process-id", "0"]))
    offload = load_config(None, ["parallel.tensor_col=2", "optim.offload=true"], check=False)
    train_cmd.check_distributed(offload, p.parse_args(["--distributed"]))  # each process offloads its shards


@pytest.mark.slow  # a 2-process launch and a one-process resume, each compiling: about 60 s on 2 cores
@pytest.mark.mpi
def test_one_process_resumes_a_distributed_checkpoint_on_the_same_mesh(tmp_path):
    """``--distributed`` writes global arrays with their shardings (and, offloaded, the host state as pytrees
    of global arrays); one process with the same mesh must resume it, not stop at orbax's "Topology
    mismatch" (the sharded compute params) or tree-structure mismatch (the offloaded state). Offloaded, the
    run meets both (each fix reverted alone fails here); without offload only the first."""
    import json
    from pathlib import Path

    run = tmp_path / "run"
    common = ["--config", "configs/runs/tiny.yaml", "--set", f"run.dir={run}", "--set", "parallel.data=2",
              "--set", "parallel.tensor_row=2", "--set", "parallel.tensor_col=2", "--set", "model.n_layers=1",
              "--set", "train.global_batch=8", "--set", "data.seq_len=16", "--set", "train.eval_every=0",
              "--set", "metrics.plot=false", "--set", "metrics.tensorboard=false",
              "--set", "optim.offload=true", "--set", "optim.bucket_size=4000"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(OMP_NUM_THREADS="1", MPIEXEC_TIMEOUT="240")
    root = Path(__file__).resolve().parents[2]
    exe = [sys.executable, "-m", "jaxhybrid"]
    first = subprocess.run(exe + ["launch", "-n", "2", "--", "--distributed", *common, "--set", "train.steps=1"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    second = subprocess.run(exe + ["train", *common, "--set", "train.steps=2", "--resume"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
