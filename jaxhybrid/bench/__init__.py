"""Benchmarks: each measures variants side by side in one run and prints ratios as JSON."""
