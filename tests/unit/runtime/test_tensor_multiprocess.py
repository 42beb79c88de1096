"""``--distributed`` (jax.distributed over processes, one tensor-mode mesh): where the peers come from and
the checks made before any process waits. The runs themselves are tests/mpi/test_mpi_resume.py's
test_distributed_tensor_mode_matches_one_process_and_resumes: two processes against one (losses, the
trained checkpoint), their resume, and one process resuming the two's checkpoint on the same mesh."""
from __future__ import annotations

import pytest

from jaxhybrid.core import launch_env


def test_distributed_peers_and_layout_are_checked_before_any_process_waits():
    """``jaxhybrid train --distributed``: where the peers come from, and the errors for a bad launch or a
    layout that is not one tensor-mode mesh (all raised before the distributed runtime starts)."""
    import argparse

    from jaxhybrid.cli.commands import train as train_cmd
    from jaxhybrid.core.errors import ConfigError
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.distributed import peer_arguments

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
    from jaxhybrid.runtime.distributed import initialize

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


@pytest.mark.parametrize("args, message", [
    (("node0:99999", 2, 0), r"--coordinator 'node0:99999': port 99999 must be in \[1, 65535\]"),
    (("node0:0", 2, 0), r"--coordinator 'node0:0': port 0 must be in \[1, 65535\]"),
    (("node0:1234", 0, 0), r"^--num-processes 0 must be >= 1$"),
])
def test_explicit_peers_name_the_value_that_is_wrong(args, message):
    """A port past 65535 was accepted (left to the distributed runtime's bind or connect, after the
    processes started), and --num-processes 0 was reported as '--process-id 0 must be in [0,
    --num-processes 0)', naming the process id, which was right."""
    from jaxhybrid.runtime.distributed import peer_arguments

    with pytest.raises(ValueError, match=message):
        peer_arguments(*args)


LAUNCHER_VARS = (*launch_env.MPI_RANK_VARS, *launch_env.MPI_SIZE_VARS, *launch_env.LOCAL_RANK_VARS,
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")


MPIRUN_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                 "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # mpirun, all of the node's GPUs visible
PEERS = {"coordinator_address": "node0:1234", "num_processes": 4, "process_id": 1}  # mpi4py's rank 0 broadcast


def _choose_devices(monkeypatch, launcher: dict, sets: list[str], initialize=None):
    """``jaxhybrid train``'s config and device choice on a rank of a pipeline x data x tensor grid (2 x 2 x 2
    devices on 4 ranks) that ``launcher``'s variables describe, with ``sets``; returns the config and the
    calls made to ``jax.distributed.initialize`` (keyword dicts) and ``jax.config.update`` (pairs)."""
    import argparse

    import jax

    from jaxhybrid.cli.commands import train as train_cmd
    from jaxhybrid.runtime import distributed

    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", initialize or (lambda **kw: calls.append(kw)))
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    monkeypatch.setattr(distributed, "_from_mpi", lambda: dict(PEERS))
    args = argparse.Namespace(config=None, overrides=["parallel.pipeline=2", "parallel.data=2",
                                                      "parallel.tensor_col=2", *sets], resume=False, distributed=False)
    cfg = train_cmd.load_train_config(args)
    train_cmd.choose_devices(cfg, args, 4)
    return cfg, calls


@pytest.mark.parametrize("launcher, backend, expected", [
    # mpirun: rank 1's block of 2 is GPUs 2 and 3, either way.
    (MPIRUN_RANK_1, "xla", {"local_device_ids": [2, 3]}),
    (MPIRUN_RANK_1, "mpi", ("jax_cuda_visible_devices", "2,3")),
    # srun --gpus-per-task=2: the task sees its 2 GPUs as 0 and 1, where JAX alone would keep [SLURM_LOCALID].
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
      "CUDA_VISIBLE_DEVICES": "6,7"}, "xla", {"local_device_ids": [0, 1]}),
])
def test_an_mpi_rank_computes_on_its_own_gpu_block(monkeypatch, launcher, backend, expected):
    """With ``optim.allreduce_backend=xla`` a rank joins JAX's distributed runtime with its node-local GPU
    block as ``local_device_ids``. It used to pass none, and JAX's own Slurm and Open MPI detection then
    kept one GPU per process, number ``SLURM_LOCALID``: one GPU short of the rank's tensor mesh, and a GPU
    the task does not see under ``srun --gpus-per-task``. With ``mpi`` the rank sets the block itself."""
    _, calls = _choose_devices(monkeypatch, launcher, [f"optim.allreduce_backend={backend}"])
    if backend == "xla":
        joined = [c for c in calls if isinstance(c, dict)]
        assert len(joined) == 1 and joined[0]["local_device_ids"] == expected["local_device_ids"]
        if "OMPI_COMM_WORLD_RANK" in launcher:
            assert {k: joined[0][k] for k in PEERS} == PEERS
    else:
        assert calls == [expected]


@pytest.mark.parametrize("platforms, backend", [("cuda", "xla"), ("cpu", "mpi")])
def test_gpu_replicas_sum_on_xla_by_default_and_cpu_replicas_on_mpi(monkeypatch, platforms, backend):
    """``optim.allreduce_backend: auto`` (the default): GPU ranks join JAX's distributed runtime, their
    columns summed by NCCL where the gradients are; CPU ranks sum over MPI, the faster there. Each rank
    resolves it alike, from what JAX will compute on, before JAX starts."""
    cfg, calls = _choose_devices(monkeypatch, {**MPIRUN_RANK_1, "JAX_PLATFORMS": platforms}, [])
    assert cfg.optim.allreduce_backend == backend
    joined = [c for c in calls if isinstance(c, dict)]
    if backend == "xla":
        assert len(joined) == 1 and joined[0]["local_device_ids"] == [2, 3]
    else:
        assert calls == [("jax_cuda_visible_devices", "2,3")]


def test_a_distributed_runtime_that_does_not_start_names_the_mpi_backend(monkeypatch):
    """Where JAX's distributed runtime cannot start (no route to rank 0's coordinator, a cluster that
    forbids it), the xla sum cannot run; the error says so and names the setting that sums over MPI alone."""
    from jaxhybrid.core.errors import ConfigError

    def refuse(**kw):
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")

    with pytest.raises(ConfigError, match=r"optim.allreduce_backend=xla needs JAX's distributed runtime, which "
                                          r"did not start \(DEADLINE_EXCEEDED.*--set optim.allreduce_backend=mpi"):
        _choose_devices(monkeypatch, {**MPIRUN_RANK_1, "JAX_PLATFORMS": "cuda"}, [], initialize=refuse)
