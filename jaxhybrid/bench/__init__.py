"""Benchmarks: each measures variants side by side in one run and prints ratios as JSON."""
from __future__ import annotations

import argparse
import subprocess
import sys

from jaxhybrid.cli.commands.launch import find_mpiexec, job_cpus, rank_environment
from jaxhybrid.core.argtypes import positive_int

WORKER_FLAG = "--worker"  # a benchmark relaunched under mpiexec: this process is one of its ranks


def round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """``[min, max]`` of the per-round ratio of two series timed in the same rounds: the noise band of a
    median ratio. Why print it: on a shared machine one burst can move a 2-round median by 4x, and a
    ratio without its spread reads as a result."""
    r = [a / b for a, b in zip(numerator, denominator)]
    return [min(r), max(r)] if r else []


def add_mpirun_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that relaunches itself under mpiexec (:func:`relaunch`), and its output."""
    p.add_argument("--cores", type=positive_int, default=None, help="cores shared by the ranks (default: all)")
    p.add_argument("--timeout", type=int, default=600, help="seconds the mpirun job may take (MPIEXEC_TIMEOUT)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)


def relaunch(bench: str, ranks: int, args: argparse.Namespace, argv: list[str]) -> int:
    """``jaxhybrid bench BENCH ARGV --worker`` on ``ranks`` ranks of the venv's mpiexec, each pinned to its
    share of the cores, as ``jaxhybrid launch`` runs them; its exit code."""
    env = rank_environment(ranks, job_cpus(args.cores or 0), args.timeout)
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "jaxhybrid", "bench", bench,
           *argv, WORKER_FLAG]
    return subprocess.call(cmd, env=env)
