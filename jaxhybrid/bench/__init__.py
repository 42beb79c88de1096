"""Benchmarks: each measures variants side by side in one run and prints ratios as JSON."""
from __future__ import annotations


def round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """``[min, max]`` of the per-round ratio of two series timed in the same rounds: the noise band of a
    median ratio. Why print it: on a shared machine one burst can move a 2-round median by 4x, and a
    ratio without its spread reads as a result."""
    r = [a / b for a, b in zip(numerator, denominator)]
    return [min(r), max(r)] if r else []
