"""The planner's keys of a ``configs/hardware`` file, checked when the planner reads it.

Why here and not where they are used: the values flow into :class:`~jaxhybrid.planner.comm_model.Network`
and the step model as plain floats, so a wrong one surfaced far away or not at all (a negative memory
ranked against "-9e-10 GB usable", ``gpus_per_node: 0`` was blamed on ``--gpus-per-node``, a zero
``host_to_device`` divided by zero in the offload model, text raised Python's bare conversion error).
:func:`jaxhybrid.model.flops.load_hardware` checks the keys every reader needs (``peak_tflops``,
``device_kinds``); these are the ones only the planner reads.
"""
from __future__ import annotations

import math


def as_number(value) -> float | None:
    """``value`` as a float, written as YAML reads it, else None (a boolean too). PyYAML takes a float with
    no dot or no exponent sign (``80.0e9``, ``2e-05``) for a string; the shipped files hold such numbers and
    ``json.dumps`` prints them, so the planner converts with ``float``."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _positive(value) -> bool:
    """A finite number > 0 (:func:`as_number`)."""
    v = as_number(value)
    return v is not None and 0 < v < math.inf


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def planner_key_errors(hw: dict) -> list[str]:
    """What is missing or out of range among the keys the planner reads, one phrase each (empty: none)."""
    missing = [k for k in ("name", "memory_bytes", "gpus_per_node") if k not in hw]
    if missing:
        return [f"{k} is missing" for k in missing]
    bad = [] if _positive(hw["memory_bytes"]) else [f"memory_bytes={hw['memory_bytes']!r} must be a finite number > 0"]
    if not _count(hw["gpus_per_node"]):
        bad.append(f"gpus_per_node={hw['gpus_per_node']!r} must be an integer >= 1")
    bw = hw["bandwidth"]
    for key in ("inter_node", "host_to_device"):  # host_to_device: the offloaded optimizer's copies
        if key not in bw:
            bad.append(f"bandwidth.{key} is missing (bytes/s per direction)")
        elif not _positive(bw[key]):
            bad.append(f"bandwidth.{key}={bw[key]!r} must be a finite number > 0 (bytes/s per direction)")
    intra = bw["intra_node"]
    if not isinstance(intra, list) or not all(isinstance(e, dict) for e in intra):
        return bad + [f"bandwidth.intra_node={intra!r} must be a list of {{span: GPUs, bytes_per_s: B}}"]
    for i, e in enumerate(intra):
        if not _count(e.get("span")):
            bad.append(f"bandwidth.intra_node[{i}].span={e.get('span')!r} must be an integer >= 1")
        if not _positive(e.get("bytes_per_s")):
            bad.append(f"bandwidth.intra_node[{i}].bytes_per_s={e.get('bytes_per_s')!r} must be a finite number > 0")
    return bad
