"""The checks of a ``jaxhybrid launch`` job made once before mpiexec starts: each is a check every rank
would make alike without its peers, so a mistake prints one ``jaxhybrid launch: error`` naming the
values instead of one error per rank (sometimes two ranks' run together on one line) and an abort.

Each check is the ranks' own function, run here on what the ranks will be given: train's argument parser
and :func:`~jaxhybrid.cli.commands.train.check_run` (the config against ``-n``, a plan file, ``run.dir``), and
on CPU the device checks of the rank's mesh against the device count of the ranks' environment.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from jaxhybrid.cli.commands import train as train_cmd
from jaxhybrid.cli.commands.train import check_run
from jaxhybrid.core.launch_env import accelerator_backend
from jaxhybrid.runtime.data.splits import check_data
from jaxhybrid.runtime.distributed import devices_per_process
from jaxhybrid.runtime.host_alloc import DEVICE_COUNT_FLAG, cpu_devices
from jaxhybrid.runtime.run_lock import RunLock


def train_config(train_args: list[str]):
    """``(train options, config)`` of the ranks' train arguments, read as `jaxhybrid train` reads them: a
    wrong option, a missing config or plan file fails here once, not on every rank."""

    p = argparse.ArgumentParser(prog="jaxhybrid train", description="the ranks' arguments")
    train_cmd.add_arguments(p)
    args = [a for a in train_args if a != "--"]
    ns = p.parse_args(args[1:] if args[:1] == ["train"] else args)
    return ns, train_cmd.load_train_config(ns)


def check_job(ns, cfg, n: int) -> int:
    """The checks every rank would make alike, made once before any rank starts (train's own
    :func:`~jaxhybrid.cli.commands.train.check_run`: the config against ``-n``, ``run.dir`` and its lock; a given data
    path, :func:`~jaxhybrid.runtime.data.splits.check_data`), and with
    ``--distributed`` that the ``n`` processes split the mesh evenly. Returns the devices each rank needs
    (:func:`devices_per_rank`)."""

    check_run(cfg, ns, n)
    RunLock(cfg.run.dir).check_free()  # another job training into run.dir
    check_data(cfg)
    return devices_per_rank(ns, cfg, n)


def check_devices(cfg, n: int, env: dict[str, str], per_rank: int) -> None:
    """On CPU, the devices each of the ``n`` ranks will see (``env``'s count: ``per_rank`` as the launcher
    sets it, unless the user set one) against those its mesh needs, by the ranks' own checks: a hybrid
    rank's local mesh (:func:`~jaxhybrid.parallel.tensor.local.rank_devices`; node-local rank 0 needs the fewest),
    or one tensor-mode mesh over the ``n`` processes (:meth:`~jaxhybrid.core.layout.ParallelDims.check_devices`).
    Skipped where the ranks will compute on an accelerator (:func:`~jaxhybrid.core.launch_env.accelerator_backend`):
    the count only shapes the CPU platform."""
    from types import SimpleNamespace

    if not (cfg.tensor_size > 1 or cfg.on_mesh) or accelerator_backend(env):
        return
    count = cpu_devices(env)
    try:
        if cfg.world_size > 1:
            from jaxhybrid.parallel.tensor.local import rank_devices

            rank_devices(cfg.tensor_size, [SimpleNamespace(platform="cpu")] * count, node_rank=0)
        else:
            cfg.layout.check_devices(count * n)
    except ValueError as e:
        yours = [f"JAX_NUM_CPU_DEVICES={env['JAX_NUM_CPU_DEVICES']}"] if env.get("JAX_NUM_CPU_DEVICES") else []
        yours += re.findall(DEVICE_COUNT_FLAG + r"=\d+", env.get("XLA_FLAGS", ""))
        raise ValueError(f"your {' and '.join(yours)} (kept by the launcher) gives each of the {n} ranks {count} "
                         f"CPU device(s): {e}; without it the launcher gives each rank {per_rank}") from None


def devices_per_rank(ns, cfg, n: int = 1) -> int:
    """Devices each rank's tensor mesh needs: ``G_d G_r G_c`` in hybrid layouts, the whole mesh in tensor
    mode, the mesh's share of each of the ``n`` processes with ``--distributed``."""

    if ns.distributed:
        return devices_per_process(cfg.num_devices, n)
    return max(1, cfg.num_devices // cfg.world_size)


def find_mpiexec(explicit: str = "") -> str:
    """``explicit`` (a path, or a name looked up on PATH as the shell would), else the venv's mpiexec
    (the mpich wheel's), then PATH. An ``explicit`` one that cannot run is named here: Popen's own
    error was a bare ``[Errno 2]`` (missing) or a traceback (a folder, a file without execute
    permission), after the job's checks had passed."""
    if explicit:
        found = shutil.which(explicit)  # None unless an executable file (a name without "/" searches PATH)
        if found:
            return found
        p = Path(explicit)
        why = ("is not on PATH" if "/" not in explicit else "does not exist") if not p.exists() else \
            "is a folder" if p.is_dir() else "is not executable"
        raise ValueError(f"--mpiexec {explicit} {why}: give an MPI launcher (mpiexec or mpirun), or leave "
                         f"--mpiexec out to use the one next to this Python")
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec next to this Python nor on PATH; install the mpich wheel "
                                "(pip install mpich) or pass --mpiexec")
    return found


def check_script(script: str) -> None:
    """``--script`` is a file: a missing one started the job anyway, and every rank printed runpy's
    FileNotFoundError traceback."""
    if not Path(script).is_file():
        why = "is a folder" if Path(script).is_dir() else "does not exist"
        raise ValueError(f"--script {script} {why}: give the Python file every rank runs")
