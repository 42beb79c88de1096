"""What the launcher tells each process through its environment, read without starting MPI or JAX.

One place for the variable names of the launchers users start jaxhybrid with: mpich/hydra (``PMI_*``,
``MPI_LOCAL*``), Open MPI (``OMPI_COMM_WORLD_*``), PMIx (``PMIX_RANK``) and Slurm's ``srun``
(``SLURM_*``; ``SLURM_NTASKS`` alone is also set inside an ``sbatch`` script, where it is not a rank's).
"""
from __future__ import annotations

import os
from typing import Mapping

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS_WORLD")
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for var in names:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def slurm_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``srun`` started this process as one task of a job step."""
    env = _env(env)
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def mpi_rank_set(env: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (mpirun/mpiexec, ``jaxhybrid launch``) started this process."""
    return any(v in _env(env) for v in MPI_RANK_VARS)


def world_size(env: Mapping[str, str] | None = None) -> int:
    """Processes the launcher started (1 when none did)."""
    env = _env(env)
    n = _first_int(env, MPI_SIZE_VARS)
    if n is None and slurm_task(env):
        n = _first_int(env, ("SLURM_NTASKS",))
    return 1 if n is None else n


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank among the launcher's processes on its node; None when no launcher names one."""
    return _first_int(_env(env), LOCAL_RANK_VARS)
