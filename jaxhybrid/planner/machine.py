"""The machine a plan runs on (:class:`~jaxhybrid.planner.step_model.Machine`) from a ``configs/hardware`` file:
peak flop/s of the dtype times an efficiency, and the fixed time per block pass the file measured, the
usable memory per device, and the network of AxoNN's model.
"""
from __future__ import annotations

from jaxhybrid.core.hardware import peak_tflops
from jaxhybrid.core.launch_env import DEVICE_MEMORY_FRACTION
from jaxhybrid.planner.comm_model import Network
from jaxhybrid.planner.hardware_checks import as_number
from jaxhybrid.planner.step_model import DTYPE_BYTES, Machine

DEFAULT_EFFICIENCY = 0.5  # fraction of peak where the hardware file measured no compute_model


def overheads_ok(over) -> bool:
    """Two seconds per block (forward, backward), each a real number in [0, 1): the one rule for the
    hardware file's ``block_overhead_s``, ``plan --block-overhead`` and :func:`machine_from_hardware`."""
    return isinstance(over, (list, tuple)) and len(over) == 2 and all(
        (n := as_number(v)) is not None and 0 <= n < 1 for v in over)


def compute_model(hw: dict, dtype: str) -> tuple[float | None, tuple[float, float]]:
    """``(efficiency, (forward, backward) seconds per block)`` of the hardware file's measured
    ``compute_model`` for ``dtype`` (:class:`~jaxhybrid.planner.step_model.Machine`), ``(None, (0, 0))``
    where it has none; a malformed entry is a ValueError naming it."""
    models = hw.get("compute_model") or {}
    if not isinstance(models, dict):
        raise ValueError(f"hardware {hw['name']!r}: compute_model={models!r} must map a dtype to {{efficiency, "
                         f"block_overhead_s}}")
    entry = models.get(dtype)
    if entry is None:
        return None, (0.0, 0.0)
    eff, over = (as_number(entry.get("efficiency")), entry.get("block_overhead_s")) if isinstance(entry, dict) \
        else (None, None)
    if not (eff is not None and 0 < eff <= 1 and overheads_ok(over)):
        raise ValueError(f"hardware {hw['name']!r}: compute_model.{dtype}={entry!r} must be {{efficiency: a fraction "
                         f"in (0, 1], block_overhead_s: [forward, backward] seconds per block, each in [0, 1)}}")
    return float(eff), (float(over[0]), float(over[1]))


def machine_from_hardware(hw: dict, gpus_per_node: int, dtype: str, efficiency: float | None = None,
                          memory_fraction: float | None = None,
                          block_overhead_s: tuple[float, float] | None = None) -> Machine:
    """A :class:`Machine` using ``gpus_per_node`` of each node's GPUs (at most the hardware file's), whose
    memory is the usable share of each device's: ``memory_fraction``, else the file's
    ``usable_memory_fraction``, else :data:`~jaxhybrid.core.launch_env.DEVICE_MEMORY_FRACTION`: the share
    `jaxhybrid train` lets XLA preallocate; the rest holds the CUDA context, XLA's scratch buffers and
    fragmentation, none of which the memory model counts. ``efficiency`` and ``block_overhead_s`` (the
    compute curve) default to the file's measured ``compute_model`` for ``dtype``, else
    :data:`DEFAULT_EFFICIENCY` and no overhead. An explicit ``efficiency`` alone means a flat curve (no
    overhead): the file's overheads were fitted together with its own efficiency."""
    if not 1 <= gpus_per_node <= int(hw["gpus_per_node"]):
        raise ValueError(f"--gpus-per-node={gpus_per_node} must be in [1, {hw['gpus_per_node']}]: hardware "
                         f"{hw['name']!r} has gpus_per_node={hw['gpus_per_node']}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    file_eff, file_over = compute_model(hw, dtype)
    if block_overhead_s is None:
        block_overhead_s = file_over if efficiency is None else (0.0, 0.0)
    efficiency = efficiency if efficiency is not None else file_eff or DEFAULT_EFFICIENCY
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency} must be in (0, 1]")
    if not overheads_ok(block_overhead_s):
        raise ValueError(f"block overhead {block_overhead_s} must be two seconds per block (forward, backward), each "
                         f"in [0, 1)")
    over = (float(block_overhead_s[0]), float(block_overhead_s[1]))
    if memory_fraction is None:
        memory_fraction = hw.get("usable_memory_fraction", DEVICE_MEMORY_FRACTION)
    if not isinstance(memory_fraction, (int, float)) or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction {memory_fraction!r} (plan --memory-fraction, or hardware {hw['name']}'s "
                         f"usable_memory_fraction) must be in (0, 1]")
    flash = hw.get("flash_attention", False)
    if not isinstance(flash, bool):
        raise ValueError(f"hardware {hw['name']!r}: flash_attention={flash!r} must be true or false")
    peak = peak_tflops(hw, dtype) * 1e12
    return Machine(peak * efficiency, float(hw["memory_bytes"]) * memory_fraction,
                   Network.from_hardware(hw, gpus_per_node), DTYPE_BYTES[dtype], flash, over)


def fit_compute_model(points: list[tuple[float, float, float]], peak_flops_per_s: float) -> dict:
    """The ``compute_model`` entry that best explains measured block passes: ``points`` are ``(flops per
    block, seconds per block, 0 for a forward or 1 for a backward)``, and the fit is one efficiency for both
    passes plus an overhead each, ``seconds = flops / (efficiency x peak) + overhead``, by least squares on
    the relative error (a 0.1 ms pass weighs as much as a 10 ms one). Returns ``{"efficiency",
    "block_overhead_s": [forward, backward], "max_rel_err"}``; ``jaxhybrid bench curve`` measures the
    points. Why this form: :class:`~jaxhybrid.planner.step_model.Machine` (a constant efficiency made the
    planner take microbatch 1 every time)."""
    import numpy as np

    if {kind for _, _, kind in points} != {0, 1} or len(points) < 3:
        raise ValueError(f"fitting a compute model needs forward and backward passes, at least 3 points in all; "
                         f"got {len(points)} with kinds {sorted({kind for _, _, kind in points})}")
    x = np.array([[f, kind == 0, kind == 1] for f, _, kind in points], dtype=float)
    t = np.array([s for _, s, _ in points], dtype=float)
    coef = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]
    if coef[0] <= 0:
        raise ValueError("the measured times do not grow with the flops; measure larger microbatches")
    coef[1:] = np.maximum(coef[1:], 0.0)  # a negative overhead (noise on a flat curve) is none
    err = x @ coef / t - 1
    return {"efficiency": float(1 / (coef[0] * peak_flops_per_s)),
            "block_overhead_s": [float(coef[1]), float(coef[2])], "max_rel_err": float(np.abs(err).max())}
