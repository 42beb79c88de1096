"""What the launcher tells each process through its environment, read without starting MPI or JAX.

One place for the variable names of the launchers users start jaxhybrid with: mpich/hydra (``PMI_*``,
``MPI_LOCAL*``), Open MPI (``OMPI_COMM_WORLD_*``), PMIx (``PMIX_RANK``) and Slurm's ``srun``
(``SLURM_*``; ``SLURM_NTASKS`` alone is also set inside an ``sbatch`` script, where it is not a rank's);
and what the environment tells JAX before it starts: its GPU memory share and what it will compute on.
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
    """Whether ``srun`` started this process as one task of a job step. Not when an MPI launcher's rank or
    size disagrees with Slurm's: then mpirun (``jaxhybrid launch``) started it inside a Slurm shell (an
    ``srun --pty bash`` step, or an sbatch script, which runs as task 0), whose ``SLURM_PROCID``/``SLURM_NTASKS``
    every rank inherits; read as the ranks', every process took itself for task 0 of that step. ``srun
    --mpi=pmi2``/``pmix`` sets both alike."""
    env = _env(env)
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    rank, size = _first_int(env, MPI_RANK_VARS), _first_int(env, MPI_SIZE_VARS)
    return ((rank is None or str(rank) == env["SLURM_PROCID"])
            and (size is None or str(size) == env["SLURM_NTASKS"]))


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


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
# The CPUs ``jaxhybrid launch`` lets its ranks share, comma-separated; each rank pins itself to its part.
RANK_CPUS_ENV = "JAXHYBRID_RANK_CPUS"


def local_size(env: Mapping[str, str] | None = None) -> int:
    """Processes the launcher started on this node (the world size when it names no node count)."""
    env = _env(env)
    n = _first_int(env, LOCAL_SIZE_VARS)
    return world_size(env) if n is None else n


def rank_cpus(cpus: list[int], rank: int, n: int) -> list[int]:
    """Local rank ``rank``'s share of ``cpus`` among ``n`` ranks: contiguous blocks as even as possible
    when there are at least as many CPUs as ranks, else one CPU each, dealt round-robin."""
    if not cpus or not 0 <= rank < n:
        raise ValueError(f"rank {rank} of {n} ranks on CPUs {cpus}: need 0 <= rank < n and some CPUs")
    if n > len(cpus):
        return [cpus[rank % len(cpus)]]
    per, extra = divmod(len(cpus), n)
    lo = rank * per + min(rank, extra)
    return cpus[lo:lo + per + (rank < extra)]


def bind_rank_cpus(env: Mapping[str, str] | None = None) -> list[int] | None:
    """Pin every thread of this process to its share of ``$JAXHYBRID_RANK_CPUS`` (set by ``jaxhybrid
    launch``); returns the CPUs, or None when not launched so. Call it before JAX starts its CPU client:
    XLA sizes its thread pool from this affinity. Why: unpinned ranks sharing a machine migrate between
    cores, and their pools and MPI's yielding waits run into each other; pinned, an oversubscribed job
    steps markedly faster."""
    env = _env(env)
    spec, rank = env.get(RANK_CPUS_ENV, ""), local_rank(env)
    if not spec or rank is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        mine = rank_cpus([int(c) for c in spec.split(",")], rank, local_size(env))
    except ValueError as e:  # a malformed list, or a rank count that does not match it
        raise ValueError(f"{RANK_CPUS_ENV}={spec!r} for local rank {rank}: {e}") from None
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:  # threads started so far keep their mask unless set one by one
        try:
            os.sched_setaffinity(int(tid), mine)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:  # a CPU outside this process's cgroup: run unpinned rather than fail the job
            print(f"jaxhybrid: rank {rank} not pinned to CPUs {mine} ({e}); unset {RANK_CPUS_ENV} to silence",
                  flush=True)
            return None
    return mine


# Share of each GPU's memory a training process lets XLA preallocate, and the share the planner lets a layout
# fill (planner.plan.machine_from_hardware): JAX's own default, 0.75, would leave a plan that the planner
# fits near 90% short. The rest holds the CUDA context and what XLA allocates outside its pool.
DEVICE_MEMORY_FRACTION = 0.9
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def reserve_device_memory(env=None) -> str:
    """Set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to :data:`DEVICE_MEMORY_FRACTION` unless the environment sets
    it (or turns preallocation off); returns the value in force. Before JAX starts its GPU client; no
    effect on CPU."""
    env = os.environ if env is None else env
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return env.get(MEM_FRACTION_ENV, "")
    return env.setdefault(MEM_FRACTION_ENV, str(DEVICE_MEMORY_FRACTION))


def terminal_signals(pid: int) -> bool:
    """Whether a Ctrl-C typed at this process's controlling terminal reaches process ``pid`` too (the
    terminal signals its foreground process group): then `jaxhybrid launch` must not pass its own SIGINT
    on to mpiexec, which got one already and would count a second as "stop at once". Without a terminal,
    or with mpiexec in the background, a SIGINT was sent to the launcher alone (or ``pid`` has ended)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgid(pid)
    except OSError:
        return False
    finally:
        os.close(fd)


def accelerator_backend(environ) -> str | None:
    """What JAX will compute on instead of the CPU, or None for the CPU: the first of ``JAX_PLATFORMS``,
    else the accelerator plugins installed (JAX finds them in the ``jax_plugins`` namespace package or
    entry-point group and prefers them to the CPU). Read without starting JAX."""
    import importlib.metadata
    import importlib.util
    import pkgutil

    if environ.get("JAX_PLATFORMS", "").strip():
        first = environ["JAX_PLATFORMS"].split(",")[0].strip()
        return None if first == "cpu" else f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
    spec = importlib.util.find_spec("jax_plugins")
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations or [])] if spec else []
    names += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    return f"the plugin(s) {', '.join(sorted(set(names)))}" if names else None


CUDA_MPI_ENV = "MPI4JAX_USE_CUDA_MPI"


def mpi_reads(platform: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether MPI can read and write a buffer of a device of ``platform`` where it lies: the CPU's (host
    memory), or a GPU's where the MPI is CUDA-aware, as the user declares it for mpi4jax
    (``MPI4JAX_USE_CUDA_MPI=1``, which makes mpi4jax hand MPI device pointers too). The mpi4jax
    transport then sends device buffers as they are (Myelin Sec. IV-A's GPUDirect path)."""
    return platform == "cpu" or (platform == "gpu" and _env(env).get(CUDA_MPI_ENV, "").lower() in ("1", "true", "on"))
