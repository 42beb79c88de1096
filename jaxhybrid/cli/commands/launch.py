"""``jaxhybrid launch -n N [--timeout S] [--] <train args>``: an MPI job of ``jaxhybrid train`` ranks.

The train arguments may follow ``--`` or come straight after the launcher's own (train's options are
also the launcher's, kept as typed: :func:`add_train_options`). Every check a rank would make alike
without its peers (the config against ``-n``, ``run.dir``, a plan file, the devices each rank will see
on CPU) is made once here before mpiexec starts, so a mistake prints one ``jaxhybrid launch: error``.

Runs the venv's ``mpiexec`` (next to this Python) with ``python -m mpi4py -m jaxhybrid train ...``, so an
uncaught exception on any rank aborts the whole job (mpich alone would leave the others hanging), with
``MPIEXEC_TIMEOUT`` as the last resort, and one thread pool per rank sized to the cores available:
``OMP_NUM_THREADS`` and XLA's CPU thread flags get ``cores // N`` threads each (oversubscribed ranks
whose pools spin starve each other). Each rank pins itself to its share of the cores before
JAX starts (``launch_env.bind_rank_cpus``, from ``jaxhybrid.cli.main``; a ``--script`` runs unpinned
unless it calls that itself), so XLA sizes its own pool to that share; ``--no-bind`` leaves the ranks free.

A rank killed by a signal leaves no Python message, and hydra's report may name a bystander. The
launcher watches the ranks while it relays the job's output and, when the job fails, names the rank that
reported its failure or else the first rank that ended abnormally (:mod:`jaxhybrid.cli.launch.rankwatch`).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxhybrid.cli.commands import train as train_cmd
from jaxhybrid.cli.launch.checks import check_devices, check_job, check_script, find_mpiexec, train_config
from jaxhybrid.cli.launch.parent_death import with_parent_death_signal
from jaxhybrid.cli.launch.rankwatch import PID_DIR_ENV, REPORT_PREFIX, TIMED_OUT, RankWatch, evidence, failure_summary
from jaxhybrid.core.argtypes import positive_int
from jaxhybrid.core.launch_env import RANK_CPUS_ENV, terminal_signals
from jaxhybrid.runtime import compile_once


# Ranks per core a job may start without --oversubscribe: the MPI tests run 4 ranks on 2 cores; far beyond
# that, ranks that each poll and run XLA's thread pool make no progress until MPIEXEC_TIMEOUT ends them.
RANKS_PER_CORE = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks (G_inter x G_data)")
    p.add_argument("--timeout", type=int, default=0, help="MPIEXEC_TIMEOUT in seconds (0: the environment's MPIEXEC_TIMEOUT if set, else none)")
    p.add_argument("--mpiexec", default="", help="mpiexec to use (default: the one next to this Python)")
    p.add_argument("--cores", type=positive_int, default=None, help="how many of the CPUs this process may use "
                   "(its affinity) to share among the ranks, the first ones (default: all)")
    p.add_argument("--no-bind", action="store_true", help="do not pin each rank to its share of the cores")
    p.add_argument("--oversubscribe", action="store_true", help=f"start more than {RANKS_PER_CORE} ranks per core "
                   "(refused otherwise: their thread pools and polling starve each other)")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, do not run")
    p.add_argument("--script", default="", help="run this Python file on every rank instead of `jaxhybrid "
                   "train` (drivers, benchmarks); the remaining arguments are its own")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of `jaxhybrid train` (or of the "
                   "--script) after --; train's own options, below, may also come before --")
    add_train_options(p.add_argument_group("options of `jaxhybrid train`, before or after --"))


class _TrainOption(argparse.Action):
    """A train option given before ``--``: kept as typed, in order, in ``train_first``."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.train_first = [*namespace.train_first, option_string, *([values] if isinstance(values, str) else [])]


def add_train_options(group) -> None:
    """``jaxhybrid train``'s options (from its ``add_arguments``, the one list of them) as options of the
    launcher too, so ``launch -n 4 --config F`` works without ``--``. Each keeps what was typed for the
    ranks' command line (:class:`_TrainOption`); :func:`train_config` then parses it as train does."""
    class Passthrough:
        def add_argument(self, *flags, action="store", metavar=None, help=None, **_):
            group.add_argument(*flags, action=_TrainOption, dest="train_first", default=[], help=help,
                               nargs=0 if action == "store_true" else None,
                               metavar=metavar or flags[-1].lstrip("-").replace("-", "_").upper())

    train_cmd.add_arguments(Passthrough())


def train_arguments(args: argparse.Namespace) -> list[str]:
    """The ranks' arguments: train options given before ``--``, then what follows it."""
    rest = list(args.train_args)
    return [*args.train_first, *(rest[1:] if rest[:1] == ["--"] else rest)]


def job_cpus(cores: int = 0) -> list[int]:
    """The CPUs a job may use: this process's affinity (all CPUs where it has none), the first ``cores``
    of them when given (0: all; `jaxhybrid launch --cores` is >= 1 where typed)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cores < 0 or cores > len(cpus):
        raise ValueError(f"--cores {cores} must be in [1, {len(cpus)}]: this process may use {len(cpus)} CPUs "
                         f"({cpus})")
    return cpus[:cores] if cores else cpus


# mpich: a blocking call's wait loop yields with nanosleep, not sched_yield (which leaves a spinning rank
# runnable beside the rank it waits for).
HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
# mpich's yield sleeps 1 ns, which the kernel stretches to the thread's timer slack (50 us by default): a
# waiting rank still woke every 50 us to poll. With 1 ms it polls 20 times less often, and a message waits
# up to 1 ms longer for a sleeping receiver.
WAIT_SLACK_NS = 1_000_000


def coarsen_timer_slack(ns: int = WAIT_SLACK_NS) -> bool:
    """Set this process's timer slack (Linux ``prctl(PR_SET_TIMERSLACK)``), which every process it starts
    inherits (mpiexec, its proxies, the ranks). False where the system has no such call."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0) == 0  # 29: PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


def check_oversubscription(n: int, cpus: list[int], allowed: bool) -> None:
    """Refuse more than :data:`RANKS_PER_CORE` ranks per core of the job unless ``--oversubscribe``."""
    if n > RANKS_PER_CORE * len(cpus) and not allowed:
        raise ValueError(f"-n {n} ranks on {len(cpus)} cores is {n / len(cpus):.0f} ranks per core, over "
                         f"{RANKS_PER_CORE}: use at most {RANKS_PER_CORE * len(cpus)} ranks here, run on more "
                         f"cores, or pass --oversubscribe")


def check_counts(n: int, timeout: int = 0) -> None:
    """``-n`` and ``--timeout``, checked before anything reads them (a config's world size among them)."""
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if timeout < 0:
        raise ValueError(f"--timeout {timeout} must be >= 0")


def rank_environment(n: int, cpus: list[int], timeout: int, base: dict[str, str] | None = None,
                     devices: int = 1, bind: bool = True) -> dict[str, str]:
    """Environment for ``n`` ranks sharing ``cpus``: thread pools of ``max(1, len(cpus) // n)`` threads,
    CPU-only XLA flags, ``devices`` CPU devices per rank when its layout has a tensor mesh (the flag only
    shapes the CPU platform: on a GPU node the ranks still use their GPUs), and with ``bind`` the CPU
    list, each rank pinning itself to its part (``launch_env.bind_rank_cpus``). With more ranks than cores,
    mpich's waits sleep (:data:`HEAVY_YIELD`: its blocking calls otherwise spin, and a rank waiting for a
    peer that shares its core takes half of that core from the peer; :func:`run` also coarsens the timer
    slack the ranks inherit, :data:`WAIT_SLACK_NS`), and ranks that build the same
    program compile it once (:mod:`~jaxhybrid.runtime.compile_once`). The thread counts always
    follow the share of cores (a user's larger ``OMP_NUM_THREADS`` would oversubscribe the pinned cores);
    XLA flags, a device count (``XLA_FLAGS`` or ``JAX_NUM_CPU_DEVICES``, which JAX prefers) and a CPU list
    that the user set win."""
    check_counts(n, timeout)
    env = dict(os.environ if base is None else base)
    threads = max(1, len(cpus) // n)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    flags = env.get("XLA_FLAGS", "")
    # Only "--" flags: XLA stops parsing XLA_FLAGS at the first token without dashes, silently.
    extra = [f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"]
    if devices > 1 and not env.get("JAX_NUM_CPU_DEVICES", "").strip():
        extra.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join([flags] + [f for f in extra if f.split("=")[0] not in flags]).strip()
    if timeout:
        env["MPIEXEC_TIMEOUT"] = str(timeout)
    if n > len(cpus):  # ranks share cores: a rank waiting in MPI sleeps instead of spinning on its peer's
        env.setdefault(HEAVY_YIELD, "1")  # core, and waits for a peer compiling the same program
        env.setdefault(compile_once.ENV, "1")
    if bind:
        env.setdefault(RANK_CPUS_ENV, ",".join(map(str, cpus)))
    return env


# Where a rank's report starts inside a line: a rank writes its error line and the newline separately,
# so another rank's report can land between them ("...nope.jsonjaxhybrid train: error: ...").
_REPORT_START = re.compile(rf"(?<=\S)(?={REPORT_PREFIX})")


def split_reports(line: str) -> list[str]:
    """``line`` cut where another rank's report begins, each part ending in a newline."""
    parts = _REPORT_START.split(line)
    return [part + "\n" for part in parts[:-1]] + parts[-1:]


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
    check_counts(args.n, args.timeout)
    cpus = job_cpus(args.cores or 0)  # None: all (a typed --cores is >= 1)
    check_oversubscription(args.n, cpus, args.oversubscribe)
    mpiexec = find_mpiexec(args.mpiexec)  # the launcher's own options before train's
    if args.script:
        check_script(args.script)
    train_args = train_arguments(args)
    job = None if args.script else train_config(train_args)  # a --script's arguments are its own
    per_rank = check_job(*job, args.n) if job else 1
    env = rank_environment(args.n, cpus, args.timeout, devices=per_rank, bind=not args.no_bind)
    if job:
        check_devices(job[1], args.n, env, per_rank)
    cmd = build_command(args.n, train_args, mpiexec, args.script)
    if args.dry_run:
        keys = ("OMP_NUM_THREADS", "XLA_FLAGS", "MPIEXEC_TIMEOUT", RANK_CPUS_ENV)
        print(" ".join(f"{k}={env[k]!r}" for k in keys if k in env) + " " + " ".join(cmd))
        return 0
    if env.get(HEAVY_YIELD) == "1":  # the ranks inherit it: their MPI waits wake less often
        coarsen_timer_slack()
    with tempfile.TemporaryDirectory(prefix="jaxhybrid-pids-") as pid_dir:
        env[PID_DIR_ENV] = pid_dir
        watch = RankWatch(Path(pid_dir), args.n)
        watch.start()
        # The launcher's death (SIGKILL included) sends mpiexec SIGTERM, which stops the ranks after a saved step.
        proc = subprocess.Popen(with_parent_death_signal(cmd), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        # SIGTERM (Slurm's time limit, scancel, a supervisor) sent to the launcher alone: pass it on, so the
        # ranks stop after their step with it saved (jaxhybrid/runtime/stop.py), and keep relaying until they end.
        # Default handling would kill the launcher and leave the ranks to die with nothing saved.
        stopped: list[str] = []

        def forward(signum, frame):
            stopped.append(signal.Signals(signum).name)
            proc.send_signal(signum)

        def ctrl_c(signum, frame):  # await the saves
            if not terminal_signals(proc.pid):  # kill -INT, a supervisor: sent to the launcher alone
                proc.send_signal(signum)  # else the terminal sent it to mpiexec too, which passes it on
            if stopped:
                raise KeyboardInterrupt  # a second Ctrl-C: stop waiting
            stopped.append("SIGINT")

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, ctrl_c)
        tail: list[str] = []
        assert proc.stdout is not None
        for chunk in proc.stdout:  # relay the job's output, remembering hydra's and the ranks' reports
            for line in split_reports(chunk):
                sys.stdout.write(line)
                if evidence(line):
                    tail.append(line)
            sys.stdout.flush()
        rc = proc.wait()
        watch.stop()
        if rc == 0 and any(TIMED_OUT in line for line in tail):
            rc = 255  # hydra's usual code for a timeout; it exits 0 after one in about one run of three
        if stopped:  # not a failure: each rank said what it saved
            print(f"jaxhybrid launch: stopped by {stopped[0]} (exit code {rc})", file=sys.stderr, flush=True)
        elif rc != 0:
            print(f"jaxhybrid launch: {failure_summary(watch, tail)}; the job was stopped (exit code {rc})",
                  file=sys.stderr, flush=True)
        return rc
