"""The host memory a job needs at the least, checked before anything is allocated: a size that cannot fit
(a ``train.global_batch`` of 1e12, a ``model.d_model`` of 1048576) is one error naming both numbers instead
of a numpy MemoryError or XLA's RESOURCE_EXHAUSTED after compiling.

A lower bound, by design (activations and XLA's buffers come on top): every process holds the global batch
of token ids (int32, ``[global_batch, seq_len + 1]``); on the CPU the devices are host memory too, so the
model state counts as well: parameters, gradients and AdamW's state (Myelin Sec. V-B's count,
:func:`jaxhybrid.optim.memory_report.model_state_bytes`) once per data replica.
"""
from __future__ import annotations

from jaxhybrid.core.errors import ConfigError
from jaxhybrid.optim.memory_report import model_state_bytes

GIB = 1 << 30


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
