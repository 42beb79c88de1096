"""The memory and disk a job needs at the least, checked before anything is allocated: a size that cannot
fit (a ``train.global_batch`` of 1e12, a ``model.d_model`` of 1048576, checkpoints larger than the disk) is
one error naming both numbers instead of a numpy MemoryError, XLA's RESOURCE_EXHAUSTED after compiling, or a
save that fills the disk hours into the run.

Lower bounds, by design (activations and XLA's buffers come on top), so that no job that fits is refused:
- host: every process holds the global batch of token ids (int32, ``[global_batch, seq_len + 1]``); on the
  CPU the devices are host memory too, so the model state counts as well: parameters, gradients and AdamW's
  state (Myelin Sec. V-B's count, :func:`jaxhybrid.optim.memory_report.model_state_bytes`) once per replica;
- device (an accelerator): the model state of a device holding the average share of the parameters, one
  ``1 / (pipeline x tensor)`` of them (the fullest device holds at least that), against the memory XLA's
  allocator may use there;
- disk: one checkpoint, float32 parameters and AdamW's two moments (12 bytes a parameter), written once per
  MPI data replica (each rank saves its own stage), against the space free where ``run.dir`` lies.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from jaxhybrid.core.argtypes import nearest_existing
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.optim.memory_report import model_state_bytes

GIB = 1 << 30


def size_text(n: float) -> str:
    """Bytes as a person reads them: GiB from one GiB up, else MiB."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def needed_host_bytes(cfg, processes: int, devices_on_host: bool) -> dict[str, float]:
    """The parts of the job's host memory lower bound, in bytes."""
    need = {"batch": float(processes) * cfg.train.global_batch * (cfg.data.seq_len + 1) * 4}
    if devices_on_host:
        state = model_state_bytes(cfg.model.param_count(), compute_dtype=cfg.precision.compute_dtype)
        need["model_state"] = float(cfg.parallel.data) * (state["device_total"] + state["host_total"])
    return need


def check_host_memory(cfg, processes: int, devices_on_host: bool, available: int | None = None) -> None:
    """Raise :class:`ConfigError` where :func:`needed_host_bytes` exceeds the memory available."""
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    need = needed_host_bytes(cfg, processes, devices_on_host)
    if sum(need.values()) <= available:
        return
    parts = [f"the global batch of token ids, {need['batch'] / GIB:,.1f} GiB: train.global_batch="
             f"{cfg.train.global_batch} x (data.seq_len={cfg.data.seq_len} + 1) x 4 bytes on each of {processes} "
             f"process{'es' if processes > 1 else ''}"]
    if "model_state" in need:
        parts.append(f"the model state on the CPU devices, {need['model_state'] / GIB:,.1f} GiB: "
                     f"{cfg.model.param_count():,} parameters with their gradients and AdamW state x "
                     f"parallel.data={cfg.parallel.data}")
    raise ConfigError(f"this job needs at least {sum(need.values()) / GIB:,.1f} GiB of host memory ("
                      f"{'; '.join(parts)}) but {available / GIB:,.1f} GiB is available; use a smaller "
                      f"model or batch, or more machines")


def checkpoint_copies(cfg, mpi_ranks: int) -> int:
    """How many times a saved step holds each parameter: every MPI data replica saves its own; one process,
    or ``--distributed`` processes (one mesh), write each array once."""
    return cfg.parallel.data if mpi_ranks > 1 else 1


def free_disk_bytes(path: str | Path) -> int | None:
    """Bytes free on the filesystem that holds ``path`` (or would hold it: its nearest existing parent)."""
    try:
        return shutil.disk_usage(nearest_existing(Path(path).absolute())).free
    except OSError:
        return None


def check_checkpoint_disk(cfg, mpi_ranks: int, free: int | None = None) -> None:
    """Raise :class:`ConfigError` where one checkpoint of the job cannot fit in the space free at ``run.dir``
    (a run that saves none, ``checkpoint.every=0`` without ``at_end``, is not checked)."""
    if not (cfg.checkpoint.every > 0 or cfg.checkpoint.at_end):
        return
    free = free_disk_bytes(cfg.run.dir) if free is None else free
    copies = checkpoint_copies(cfg, mpi_ranks)
    need = 12.0 * cfg.model.param_count() * copies
    if free is None or need <= free:
        return
    raise ConfigError(f"a checkpoint of this job needs at least {size_text(need)} ({cfg.model.param_count():,} "
                      f"parameters x 12 bytes: float32 weights and AdamW's two moments"
                      f"{f', x parallel.data={copies} ranks saving their own copy' if copies > 1 else ''}) but the "
                      f"disk holding run.dir={cfg.run.dir} has {size_text(free)} free; free some space or set "
                      f"run.dir on a larger disk")


def needed_device_bytes(cfg) -> float:
    """The model state of a device holding the average share of the parameters (see the module's docstring)."""
    layout = cfg.layout
    phi = math.ceil(cfg.model.param_count() / (layout.pipeline * layout.tensor_size))
    return float(model_state_bytes(phi, compute_dtype=cfg.precision.compute_dtype, offload=cfg.optim.offload,
                                   bucket_size=cfg.optim.bucket_size)["device_total"])


def device_capacity(device) -> int | None:
    """The bytes XLA's allocator may use on an accelerator ``device`` (its share where ranks share one), or
    None on the CPU (host memory: :func:`check_host_memory`) and where the platform reports none."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (a plugin without memory statistics raises its own error type)
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def check_device_memory(cfg, device) -> None:
    """Raise :class:`ConfigError` where :func:`needed_device_bytes` exceeds ``device``'s capacity
    (:func:`device_capacity`); called once the backend is up, before the model is built."""
    capacity = device_capacity(device)
    need = needed_device_bytes(cfg)
    if capacity is None or need <= capacity:
        return
    lay = cfg.layout
    fixes = "more pipeline stages or tensor ranks, a smaller model" + ("" if cfg.optim.offload else ", or optim.offload=true")
    raise ConfigError(f"this job needs at least {size_text(need)} on each device ({cfg.model.param_count():,} "
                      f"parameters over parallel.pipeline={lay.pipeline} x {lay.tensor_size} tensor ranks, with their "
                      f"gradients and AdamW state in {cfg.precision.compute_dtype}, offload={cfg.optim.offload}) but "
                      f"{device.device_kind} {device.id} has {size_text(capacity)} for XLA; use {fixes}")
