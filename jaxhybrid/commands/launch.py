"""``jaxhybrid launch -n N [--timeout S] [--] <train args>``: an MPI job of ``jaxhybrid train`` ranks.

Runs the venv's ``mpiexec`` (next to this Python) with ``python -m mpi4py -m jaxhybrid train ...``, so an
uncaught exception on any rank aborts the whole job (mpich alone would leave the others hanging), with
``MPIEXEC_TIMEOUT`` as the last resort, and one thread pool per rank sized to the cores available:
``OMP_NUM_THREADS`` and XLA's CPU thread flags get ``cores // N`` threads each (oversubscribed ranks
whose pools spin starve each other, facts.md). Each rank pins itself to its share of the cores before
JAX starts (``launch_env.bind_rank_cpus``, from ``jaxhybrid.cli.main``; a ``--script`` runs unpinned
unless it calls that itself), so XLA sizes its own pool to that share; ``--no-bind`` leaves the ranks free.

A rank killed by a signal leaves no Python message, and hydra's report may name a bystander. The
launcher watches the ranks while it relays the job's output and, when the job fails, names the rank that
reported its failure or else the first rank that ended abnormally (:mod:`jaxhybrid.commands.rankwatch`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxhybrid.commands.rankwatch import PID_DIR_ENV, RankWatch, failure_summary
from jaxhybrid.launch_env import RANK_CPUS_ENV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks (G_inter x G_data)")
    p.add_argument("--timeout", type=int, default=0, help="MPIEXEC_TIMEOUT in seconds (0: none)")
    p.add_argument("--mpiexec", default="", help="mpiexec to use (default: the one next to this Python)")
    p.add_argument("--cores", type=int, default=0, help="cores to share among the ranks (default: all)")
    p.add_argument("--no-bind", action="store_true", help="do not pin each rank to its share of the cores")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, do not run")
    p.add_argument("--script", default="", help="run this Python file on every rank instead of `jaxhybrid "
                   "train` (drivers, benchmarks); the remaining arguments are its own")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of `jaxhybrid train` (after --)")


def job_cpus(cores: int = 0) -> list[int]:
    """The CPUs a job may use: this process's affinity (all CPUs where it has none), the first ``cores``
    of them when given."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cores < 0 or cores > len(cpus):
        raise ValueError(f"--cores {cores}: this process may use {len(cpus)} CPUs ({cpus})")
    return cpus[:cores] if cores else cpus


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


def rank_environment(n: int, cpus: list[int], timeout: int, base: dict[str, str] | None = None,
                     devices: int = 1, bind: bool = True) -> dict[str, str]:
    """Environment for ``n`` ranks sharing ``cpus``: thread pools of ``max(1, len(cpus) // n)`` threads,
    CPU-only XLA flags, ``devices`` CPU devices per rank when its layout has a tensor mesh (the flag only
    shapes the CPU platform: on a GPU node the ranks still use their GPUs), and with ``bind`` the CPU
    list, each rank pinning itself to its part (``launch_env.bind_rank_cpus``). Settings already made by
    the user win."""
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if timeout < 0:
        raise ValueError(f"--timeout {timeout} must be >= 0")
    env = dict(os.environ if base is None else base)
    threads = max(1, len(cpus) // n)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    flags = env.get("XLA_FLAGS", "")
    # Only "--" flags: XLA stops parsing XLA_FLAGS at the first token without dashes, silently.
    extra = [f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"]
    if devices > 1:
        extra.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join([flags] + [f for f in extra if f.split("=")[0] not in flags]).strip()
    if timeout:
        env["MPIEXEC_TIMEOUT"] = str(timeout)
    if bind:
        env.setdefault(RANK_CPUS_ENV, ",".join(map(str, cpus)))
    return env


def train_config(train_args: list[str]):
    """``(train options, config)`` of the ranks' train arguments, or None when they cannot be read (the
    ranks load the same arguments and name the problem)."""
    from jaxhybrid.commands import train as train_cmd
    from jaxhybrid.config import load_config

    p = argparse.ArgumentParser(add_help=False)
    train_cmd.add_arguments(p)
    args = [a for a in train_args if a != "--"]
    try:
        ns, _ = p.parse_known_args(args[1:] if args[:1] == ["train"] else args)
        return ns, load_config(ns.config, ns.overrides, check=False)
    except Exception:  # noqa: BLE001
        return None


def check_job(ns, cfg, n: int) -> int:
    """The checks every rank would make alike, made once before any rank starts: the config against
    ``-n`` (the grid's rank count, or with ``--distributed`` processes that split the mesh evenly).
    Returns the devices each rank needs (:func:`devices_per_rank`)."""
    from jaxhybrid.commands.train import check_distributed
    from jaxhybrid.config import validate

    check_distributed(cfg, ns)
    per_rank = devices_per_rank(ns, cfg, n)  # --distributed: raises unless the n processes split the mesh
    validate(cfg, 1 if ns.distributed else n)
    return per_rank


def devices_per_rank(ns, cfg, n: int = 1) -> int:
    """Devices each rank's tensor mesh needs: ``G_d G_r G_c`` in hybrid layouts, the whole mesh in tensor
    mode, the mesh's share of each of the ``n`` processes with ``--distributed``."""
    from jaxhybrid.tensor.distributed import devices_per_process

    if ns.distributed:
        return devices_per_process(cfg.num_devices, n)
    return max(1, cfg.num_devices // cfg.world_size)


def build_command(n: int, train_args: list[str], mpiexec: str, script: str = "") -> list[str]:
    args = list(train_args)
    if args and args[0] == "--":
        args = args[1:]
    if script:
        return [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", script, *args]
    if args and args[0] == "train":
        args = args[1:]
    return [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "jaxhybrid", "train", *args]


def run(args: argparse.Namespace) -> int:
    cpus = job_cpus(args.cores)
    job = None if args.script else train_config(args.train_args)  # None: the ranks report what is wrong
    per_rank = check_job(*job, args.n) if job else 1
    env = rank_environment(args.n, cpus, args.timeout, devices=per_rank, bind=not args.no_bind)
    cmd = build_command(args.n, args.train_args, find_mpiexec(args.mpiexec), args.script)
    if args.dry_run:
        keys = ("OMP_NUM_THREADS", "XLA_FLAGS", "MPIEXEC_TIMEOUT", RANK_CPUS_ENV)
        print(" ".join(f"{k}={env[k]!r}" for k in keys if k in env) + " " + " ".join(cmd))
        return 0
    with tempfile.TemporaryDirectory(prefix="jaxhybrid-pids-") as pid_dir:
        env[PID_DIR_ENV] = pid_dir
        watch = RankWatch(Path(pid_dir), args.n)
        watch.start()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # relay the job's output, remembering hydra's and the ranks' reports
            sys.stdout.write(line)
            sys.stdout.flush()
            if "RUNNING AT" in line or "Abort(" in line or line.startswith("jaxhybrid"):
                tail.append(line)
        rc = proc.wait()
        watch.stop()
        if rc != 0:
            print(f"jaxhybrid launch: {failure_summary(watch, tail)}; the job was stopped (exit code {rc})",
                  file=sys.stderr, flush=True)
        return rc
