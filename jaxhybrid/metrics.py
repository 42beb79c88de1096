"""Throughput metrics: Narayanan et al. flops, MFU, Myelin's time to train, and the hardware files.

Formulas (Myelin Sec. VI-D, after Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters"), for batch ``B``, sequence ``s``, layers ``l``, hidden ``h``, vocabulary
``V`` and step time ``t``:

* flops per step with activation recomputation: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``;
  without recomputation: ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (one forward pass fewer);
* estimated time to train on 300 B tokens: ``3e11 * t / (B s)``;
* MFU: achieved flop/s per device over the hardware file's peak for the compute dtype.

The run's record of them is :class:`jaxhybrid.metrics_writer.MetricsWriter`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"
GPT3_TOKENS = 300e9  # Myelin Sec. VI-D: the GPT-3 training regime, 300 billion tokens


def flops_per_step(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """Model flops of one training step (forward + backward [+ recomputed forward]), Narayanan et al.

    Args:
      batch: sequences per step (global batch ``B``).
      seq: sequence length ``s``.
      layers: transformer blocks ``l``.
      hidden: model width ``h``.
      vocab: vocabulary ``V`` (the logits matmul).
      recompute: activation recomputation on (4 passes of the blocks: 96 = 4 x 24) or off (3: 72).
    """
    for name, v in (("batch", batch), ("seq", seq), ("layers", layers), ("hidden", hidden), ("vocab", vocab)):
        if v < 1:
            raise ValueError(f"flops_per_step: {name}={v} must be >= 1")
    b, s, l, h, v = float(batch), float(seq), float(layers), float(hidden), float(vocab)
    if recompute:
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


def tokens_per_s(batch: int, seq: int, step_time_s: float) -> float:
    return batch * seq / step_time_s


def tflops_per_device(flops: float, step_time_s: float, n_devices: int = 1) -> float:
    """Achieved TFLOP/s per device for a step of ``flops`` spread over ``n_devices``."""
    return flops / step_time_s / max(1, n_devices) / 1e12


def mfu(flops: float, step_time_s: float, n_devices: int, peak_tflops: float) -> float:
    """Model flops utilisation in [0, 1]: achieved per-device flop/s over the device's peak."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops={peak_tflops} must be > 0")
    return tflops_per_device(flops, step_time_s, n_devices) / peak_tflops


def time_to_train_s(step_time_s: float, batch: int, seq: int, tokens: float = GPT3_TOKENS) -> float:
    """Myelin Sec. VI-D: estimated training time ``3e11 * t / (b s)`` on ``tokens`` tokens, in seconds."""
    return tokens * step_time_s / (batch * seq)


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
    try:
        hw = yaml.safe_load(p.read_text())
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
