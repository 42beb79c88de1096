"""The hardware files of ``configs/hardware``: peak flop/s per dtype, memory and bandwidths of a machine."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jaxhybrid.core.config.parse import read_text

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name: str) -> dict[str, Any]:
    """``configs/hardware/<name>.yaml`` (or a path to such a file), with its ``peak_tflops`` checked."""
    p = Path(name)
    if not (p.suffix in (".yaml", ".yml") and p.is_file()):
        p = HARDWARE_DIR / f"{name}.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"hardware {name!r} not found in {HARDWARE_DIR}; available: "
                                f"{', '.join(hardware_names()) or 'none'}, or a path to such a YAML file")

    text = read_text(p, "hardware file")
    try:
        hw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"hardware file {p} is malformed YAML: {e}") from None
    peaks = hw.get("peak_tflops") if isinstance(hw, dict) else None
    if not isinstance(peaks, dict) or not peaks or \
            not all(isinstance(v, (int, float)) and v > 0 for v in peaks.values()):
        raise ValueError(f"hardware file {p} needs peak_tflops: a mapping dtype -> positive TFLOP/s, got {peaks!r}")
    kinds = hw.get("device_kinds", [])
    if not isinstance(kinds, list) or not all(isinstance(k, str) and k.strip() for k in kinds):
        raise ValueError(f"hardware file {p}: device_kinds must be a list of non-empty strings, got {kinds!r}")
    return hw


def hardware_for_device(device) -> dict[str, Any] | None:
    """The hardware file of the device a run computes on (``metrics.hardware: auto``): ``cpu`` for a CPU,
    else the first file whose ``device_kinds`` holds part of the device's ``device_kind`` (any case; an
    H100 reports "NVIDIA H100 80GB HBM3"); None when no file does."""
    if device.platform == "cpu":
        return load_hardware("cpu")
    kind = device.device_kind.lower()
    for name in hardware_names():
        hw = load_hardware(name)
        if any(k.lower() in kind for k in hw.get("device_kinds", [])):
            return hw
    return None


def run_peak_flops(name: str, dtype: str, device) -> tuple[float | None, str]:
    """The per-device peak flop/s a training run's MFU divides by, from ``metrics.hardware`` (a file, or
    ``auto``: :func:`hardware_for_device` of ``device``), and a line saying what it was taken from. None
    (and why) when ``auto`` finds no file for the device: the run then records ``mfu: null`` rather than a
    wrong one."""
    hw = hardware_for_device(device) if name == "auto" else load_hardware(name)
    if hw is None:
        return None, (f"mfu not reported: no file in {HARDWARE_DIR} lists device kind {device.device_kind!r} in "
                      f"its device_kinds; set metrics.hardware to one (or to a path) for this device's peak")
    peak = peak_tflops(hw, dtype)
    return peak * 1e12, f"mfu against {hw.get('name', name)}: {peak:g} TFLOP/s {dtype} per device"


def peak_tflops(hw: dict[str, Any], dtype: str) -> float:
    """The hardware's peak TFLOP/s for ``dtype`` (e.g. ``bfloat16``)."""
    peaks = hw["peak_tflops"]
    if dtype not in peaks:
        raise ValueError(f"hardware {hw.get('name')!r} has no peak_tflops for {dtype!r}; it lists "
                         f"{', '.join(peaks)}")
    return float(peaks[dtype])
