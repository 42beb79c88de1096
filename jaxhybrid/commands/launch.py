"""``jaxhybrid launch -n N [--timeout S] [--] <train args>``: an MPI job of ``jaxhybrid train`` ranks.

Runs the venv's ``mpiexec`` (next to this Python) with ``python -m mpi4py -m jaxhybrid train ...``, so an
uncaught exception on any rank aborts the whole job (mpich alone would leave the others hanging), with
``MPIEXEC_TIMEOUT`` as the last resort, and one thread pool per rank sized to the cores available:
``OMP_NUM_THREADS`` and XLA's CPU thread flags get ``cores // N`` threads each (oversubscribed ranks
whose pools spin starve each other, facts.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks (G_inter x G_data)")
    p.add_argument("--timeout", type=int, default=0, help="MPIEXEC_TIMEOUT in seconds (0: none)")
    p.add_argument("--mpiexec", default="", help="mpiexec to use (default: the one next to this Python)")
    p.add_argument("--cores", type=int, default=0, help="cores to share among the ranks (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, do not run")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of `jaxhybrid train` (after --)")


def find_mpiexec(explicit: str = "") -> str:
    """The venv's mpiexec first (the mpich wheel's), then PATH."""
    if explicit:
        return explicit
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec next to this Python nor on PATH; install the mpich wheel "
                                "(pip install mpich) or pass --mpiexec")
    return found


def rank_environment(n: int, cores: int, timeout: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for every rank: thread pools of ``max(1, cores // n)`` threads, CPU-only XLA flags."""
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if timeout < 0:
        raise ValueError(f"--timeout {timeout} must be >= 0")
    env = dict(os.environ if base is None else base)
    threads = max(1, cores // n)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    flags = env.get("XLA_FLAGS", "")
    extra = [f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}",
             f"intra_op_parallelism_threads={threads}"]
    env["XLA_FLAGS"] = " ".join([flags] + [f for f in extra if f.split("=")[0] not in flags]).strip()
    if timeout:
        env["MPIEXEC_TIMEOUT"] = str(timeout)
    return env


def build_command(n: int, train_args: list[str], mpiexec: str) -> list[str]:
    args = list(train_args)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] == "train":
        args = args[1:]
    return [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "jaxhybrid", "train", *args]


def run(args: argparse.Namespace) -> int:
    cores = args.cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    env = rank_environment(args.n, int(cores or 1), args.timeout)
    cmd = build_command(args.n, args.train_args, find_mpiexec(args.mpiexec))
    if args.dry_run:
        keys = ("OMP_NUM_THREADS", "XLA_FLAGS", "MPIEXEC_TIMEOUT")
        print(" ".join(f"{k}={env[k]!r}" for k in keys if k in env) + " " + " ".join(cmd))
        return 0
    return subprocess.call(cmd, env=env)
