"""Activation checkpointing intervals: Myelin Sec. V-A's optimal interval, and the one a whole-model engine
uses."""
from __future__ import annotations

import math


def optimal_checkpoint_interval(n_layers: int, pipeline: int) -> int:
    """Myelin Sec. V-A: ac = the factor of N / G_inter closest to sqrt(N), as its text says.

    The paper's own count of kept activations, M = G_inter (N / (G_inter ac) + 1 + ac), is least at
    ac = sqrt(N / G_inter) instead: for N = 48 on G_inter = 6, ac = 8 keeps 60 units where ac = 2 keeps 42.
    We follow the text; ``train.checkpoint_interval`` sets another interval."""
    per_stage = max(1, n_layers // pipeline)
    target = math.sqrt(n_layers)
    factors = [f for f in range(1, per_stage + 1) if per_stage % f == 0]
    return min(factors, key=lambda f: (abs(f - target), f))


def whole_model_interval(cfg) -> int:
    """Blocks per recomputed segment of an engine that runs the whole model (one device, the tensor mesh):
    ``train.checkpoint_interval``, else with ``train.remat: full`` Myelin's ac for one stage (Sec. V-A),
    else 1 (``dots`` and ``none`` wrap each block alone). A pipeline stage picks its own
    (:class:`~jaxhybrid.parallel.twobp.stage.Stage`)."""
    if cfg.train.checkpoint_interval:
        return cfg.train.checkpoint_interval
    return optimal_checkpoint_interval(cfg.model.n_layers, 1) if cfg.train.remat == "full" else 1
