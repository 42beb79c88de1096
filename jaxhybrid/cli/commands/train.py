"""``jaxhybrid train --config FILE [--set key=value ...] [--resume] [--distributed]``: one process, one MPI
rank of a pipeline/data grid, or (``--distributed``) one process of a tensor-mode mesh spanning processes."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxhybrid.core import launch_env
from jaxhybrid.core.argtypes import check_writable
from jaxhybrid.core.config.parse import flatten, lookup, parse_overrides
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.hardware import run_peak_flops
from jaxhybrid.core.launch_env import accelerator_backend, reserve_device_memory
from jaxhybrid.runtime import compile_once, distributed
from jaxhybrid.runtime.config_checks import validate
from jaxhybrid.runtime.config_notes import unread_settings_notes
from jaxhybrid.runtime.data.splits import cache_dir, repetition_notes
from jaxhybrid.runtime.metrics.writer import finite_or_none


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of overrides (configs/runs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.dir")
    p.add_argument("--distributed", action="store_true",
                   help="tensor mode over several processes (nodes): start JAX's distributed runtime so the "
                   "(data, depth, row, col) mesh spans every process's devices; under srun or mpirun the "
                   "peers are found from the launcher, elsewhere pass the three options below")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="--distributed: process 0's address")
    p.add_argument("--num-processes", type=int, default=None, help="--distributed: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="--distributed: this process's index")


def prepare(args: argparse.Namespace) -> None:
    """Before JAX starts: on a GPU, XLA preallocates the share of memory the planner fits layouts into."""
    reserve_device_memory()


def enable_compilation_cache(setting: str) -> Path | None:
    """Point JAX's persistent compilation cache at ``setting`` ("auto": ``cache_dir()/xla``; "": off) so
    a rerun, a resume or another rank with the same stage loads its executables instead of compiling.
    Process-wide and only read before the first compile, so the CLI calls it, not the Trainer. The size
    bound turns on JAX's LRU eviction, whose writes take a file lock: ranks can share one directory."""
    path = compilation_cache_path(setting)
    if path is None:
        return None
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)
    if compile_once.requested():  # ranks sharing cores: each program compiled by one of them
        compile_once.install(path)
    return path


def compilation_cache_path(setting: str) -> Path | None:
    """The folder ``run.compilation_cache`` names: ``auto`` is ``cache_dir()/xla``, ``""`` none."""
    if not setting:
        return None

    return cache_dir() / "xla" if setting == "auto" else Path(setting).expanduser()


def check_compilation_cache(cfg) -> None:
    """The cache folder can be made where :func:`enable_compilation_cache` makes it: every process of a job
    makes it after its start, so a file in its place failed each rank with a traceback naming no key."""

    setting = cfg.run.compilation_cache
    path = compilation_cache_path(setting)
    if path is None:
        return
    auto = setting == "auto"  # named with the folder it resolved to: JAXHYBRID_CACHE may be set unseen
    hint = f"; set {'JAXHYBRID_CACHE or ' if auto else ''}run.compilation_cache to a folder that can be made, or ''"
    try:
        check_writable(path, "run.compilation_cache=", directory=True, hint=hint + " for no cache")
    except ValueError as e:
        shown = f"run.compilation_cache=auto ({path})" if auto else f"run.compilation_cache={path}"
        raise ConfigError(str(e).replace(f"run.compilation_cache={path}", shown, 1)) from None


def check_distributed(cfg, args) -> None:
    """``--distributed`` runs one tensor-mode mesh over processes; its options need it."""
    if not args.distributed:
        if (args.coordinator, args.num_processes, args.process_id) != (None, None, None):
            raise ConfigError("--coordinator, --num-processes and --process-id only apply with --distributed")
        return
    p = cfg.parallel
    if not cfg.on_mesh:
        raise ConfigError(f"--distributed spans one tensor-mode mesh over processes: it needs parallel.pipeline=1 "
                          f"and a tensor grid or parallel.mesh_data=true, got pipeline={p.pipeline}, tensor depth "
                          f"x row x col = {p.tensor_depth} x {p.tensor_row} x {p.tensor_col}; pipeline layouts "
                          f"run as MPI ranks without --distributed (jaxhybrid launch)")


def load_train_config(args: argparse.Namespace):
    """The config this process trains: ``--config`` <- ``--set`` <- ``--resume``, on this platform (its
    ``auto`` settings resolved for what JAX will compute on, read before JAX starts and alike on every rank),
    not yet checked (the checks need the world size: :func:`check_run`). ``jaxhybrid launch`` loads its
    ranks' config here too."""
    from jaxhybrid.runtime.config_load import load_config

    overrides = list(args.overrides) + (["run.resume=true"] if args.resume else [])
    return load_config(args.config, overrides, check=False).on_platform(accelerator_backend(os.environ) is not None)


def check_run(cfg, args: argparse.Namespace, processes: int) -> int:
    """Every check a train process makes alike and without its peers, before it waits for one or builds
    anything: ``jaxhybrid launch`` makes them once before its ``processes`` ranks start, so a mistake
    prints once instead of once per rank. Returns the MPI ranks of the pipeline/data grid (1 under
    ``--distributed``, whose processes are one JAX mesh)."""
    from jaxhybrid.runtime.checkpoint.export import check_init_from
    from jaxhybrid.runtime.memory_check import check_checkpoint_disk, check_host_memory
    from jaxhybrid.runtime.run_dir import check_run_dir

    check_distributed(cfg, args)
    world = 1 if args.distributed else processes
    validate(cfg, world)  # every rule that needs no devices
    check_run_dir(cfg)
    check_init_from(cfg)
    check_metrics(cfg)
    check_compilation_cache(cfg)
    check_mpi4jax(cfg, world)
    check_host_memory(cfg, processes, devices_on_host=accelerator_backend(os.environ) is None)
    check_checkpoint_disk(cfg, world)
    return world


def check_metrics(cfg) -> None:
    """What the run's metrics need, checked before it builds anything: a named ``metrics.hardware`` file
    with a peak for the compute dtype (``auto`` is resolved against the device later), and tensorboardX
    where ``metrics.tensorboard`` is on."""
    import importlib.util

    m = cfg.metrics
    if m.hardware != "auto":
        try:
            run_peak_flops(m.hardware, cfg.precision.compute_dtype, device=None)  # a named file needs no device
        except (OSError, ValueError) as e:
            raise ConfigError(f"metrics.hardware={m.hardware!r}: {e}") from None
    if m.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("metrics.tensorboard=true needs the tensorboardX package (a dependency of jaxhybrid: "
                         "scripts/setup.sh installs it); install it or --set metrics.tensorboard=false")


def receives_with_mpi4jax(cfg, ranks: int) -> bool:
    """Whether the ``ranks`` MPI ranks pass activations over the mpi4jax transport."""
    return ranks > 1 and cfg.parallel.pipeline > 1 and cfg.pipeline.transport == "mpi4jax"


def check_mpi4jax(cfg, ranks: int) -> None:
    """mpi4jax where the ``ranks`` MPI ranks will call it: the default pipeline transport receives through it
    and the data replicas' all-reduce runs on it. Why here: it is an optional dependency (scripts/setup.sh
    builds it, choosing its CUDA bridge per machine), and the ranks import it only at their first receive or
    reduction, after every rank had compiled its step; a ModuleNotFoundError then aborted the job."""
    import importlib.util

    p, uses = cfg.parallel, []
    if receives_with_mpi4jax(cfg, ranks):
        uses.append(f"pipeline.transport=mpi4jax (activations between parallel.pipeline={p.pipeline} stages)")
    if ranks > 1 and p.data > 1 and cfg.optim.allreduce_backend == "mpi":
        uses.append(f"the all-reduce over parallel.data={p.data} MPI replicas")
    if uses and importlib.util.find_spec("mpi4jax") is None:
        hint = "" if p.data > 1 else "; or --set pipeline.transport=mpi4py"
        raise ConfigError(f"{' and '.join(uses)} need the mpi4jax package, which is not installed: run "
                          f"scripts/setup.sh (or pip install 'jaxhybrid[mpi]'){hint}")


def check_mpi4jax_device(cfg, ranks: int, device) -> None:
    """On a GPU the default transport receives into device buffers through mpi4jax's CUDA bridge, which
    scripts/setup.sh builds where it finds CUDA (its headers, or jax[cuda12]'s CUDA pip packages). Without
    the bridge the ranks failed at their first receive, after compiling their step; this says so once the
    backend is up, before anything is compiled. (The ``mpi`` all-reduce sums on host buffers with mpi4py
    where it overlaps the phase; its other paths would fail at their first use.)"""
    if device.platform != "gpu" or not receives_with_mpi4jax(cfg, ranks):
        return
    import mpi4jax

    if not mpi4jax.has_cuda_support():
        raise ConfigError(f"pipeline.transport=mpi4jax receives into {device.device_kind} buffers, but this "
                          f"mpi4jax was built without its CUDA bridge: rebuild it (.venv/bin/pip uninstall mpi4jax; rm "
                          f".venv/.jaxhybrid-installed; CUDA_PATH=<the CUDA toolkit> scripts/setup.sh), or --set "
                          f"pipeline.transport=transfer (JAX's transfer server) or mpi4py (host buffers)")


def plan_line(cfg, overrides: list[str]) -> str | None:
    """The keys a plan file set, with the values the run trains with: besides the layout a plan sets the
    compute dtype, global batch, remat and offload, which the user must not miss. A key the command line
    sets too is the command line's (it sits above the plan), so it is not listed."""
    if not cfg.plan.file:
        return None
    from jaxhybrid.planner.plan import load_plan_overrides

    cli = flatten(parse_overrides(overrides))
    keys = [k for k in flatten(load_plan_overrides(cfg.plan.file)) if k not in cli]
    sets = ", ".join(f"{k}={lookup(cfg, k)}" for k in keys)
    return f"jaxhybrid: plan {cfg.plan.file} sets: {sets}"


def nothing_to_train_line(cfg, summary: dict) -> str | None:
    """A resume whose checkpoint already reached ``train.steps`` trains no step; say so (exit 0 still: the
    run is complete), instead of a bare summary with ``first_loss: null``."""
    if summary["first_loss"] is not None:
        return None
    return (f"jaxhybrid: run.dir={cfg.run.dir} is already at step {summary['steps']} >= train.steps="
            f"{cfg.train.steps}; nothing to train (raise train.steps to continue)")


def choose_devices(cfg, args: argparse.Namespace, world: int) -> None:
    """Before JAX's backend starts: this process's devices, and JAX's distributed runtime where the run
    needs it (``--distributed``; MPI ranks whose data columns are JAX meshes, ``optim.allreduce_backend:
    xla``). Both pass the rank's node-local GPU block as ``local_device_ids``: without it JAX's own Slurm
    and Open MPI detection keeps one GPU per process, number ``SLURM_LOCALID``, which is not the block of a
    rank with a tensor mesh and not visible at all under ``srun --gpus-per-task``. Any other MPI rank sets
    its block as ``jax_cuda_visible_devices`` itself."""
    if args.distributed:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, mesh_devices=cfg.num_devices)
        # From here a failing process ends the job, as a pipeline rank's engine makes it: a peer waits for it
        # in the first collective (building the Trainer's state, or a step), and it in the shutdown barrier.
        distributed.abort_on_exception()
    elif world > 1 and cfg.optim.allreduce_backend == "xla":  # each data column is a JAX mesh of ranks
        try:
            distributed.initialize(mesh_devices=cfg.num_devices)
        except RuntimeError as e:  # the coordinator unreachable, or the runtime refused: say what avoids it
            raise ConfigError(f"optim.allreduce_backend=xla needs JAX's distributed runtime, which did not start "
                              f"({e}); where it cannot, --set optim.allreduce_backend=mpi sums over MPI alone") from e
    elif world > 1:
        from jaxhybrid.parallel.tensor.local import use_gpu_block  # imports jax, which starts no backend

        use_gpu_block(cfg.num_devices // world)


def run(args: argparse.Namespace) -> int:
    cfg = load_train_config(args)
    world = check_run(cfg, args, launch_env.world_size())
    choose_devices(cfg, args, world)
    import jax

    from jaxhybrid.runtime.memory_check import check_device_memory
    from jaxhybrid.runtime.nonfinite import NonFiniteStop
    from jaxhybrid.runtime.trainer import Trainer

    device = jax.local_devices()[0]  # the backend is up (its devices chosen), nothing built yet
    check_device_memory(cfg, device)
    check_mpi4jax_device(cfg, world, device)
    enable_compilation_cache(cfg.run.compilation_cache)
    trainer = Trainer(cfg, world)
    writer = trainer.engine.is_writer
    if writer:
        notes = [*repetition_notes(cfg), trainer.overlap_note(), *unread_settings_notes(cfg)]
        for line in filter(None, [plan_line(cfg, args.overrides), *(f"jaxhybrid: note: {n}" for n in notes if n)]):
            print(line, file=sys.stderr, flush=True)
    try:
        summary = trainer.run()
    except NonFiniteStop as e:  # every rank stops at the same step; the writer says why, once
        if writer:
            sys.stderr.write(f"jaxhybrid train: error: {e}\n")
        return 1
    if writer:
        if line := nothing_to_train_line(cfg, summary):
            print(line, file=sys.stderr, flush=True)

        # Strict JSON, as metrics.jsonl: a diverged or overflowed loss is null, not NaN.
        summary = {k: finite_or_none(v) for k, v in summary.items()}
        print(json.dumps({"run_dir": str(cfg.run.dir), **summary}, allow_nan=False), file=sys.stdout)
    return 0
