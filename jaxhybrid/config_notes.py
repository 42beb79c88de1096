"""Settings a run sets but does not read, named in a note when the run starts.

The pipeline section and ``metrics.trace`` belong to the MPI pipeline engine (``jaxhybrid.build``: a run of
more than one rank). A one-process run (the single-device engine, or one tensor mesh) has no schedule,
event loop, transport or watchdog, so it would drop them without a word: ``pipeline.split_backward=true``
would not split the backward and ``metrics.trace=true`` would write no trace. They are not config errors,
because a run config and a plan file set them for the layouts that read them, and a one-process override
of the layout (``--set parallel.pipeline=1``) should not have to reset them too. Likewise
``pipeline.weight_join`` in a pipeline without ``pipeline.split_backward`` (a plan may turn the split off),
and the data all-reduce's settings in a run without data replicas as MPI ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxhybrid.config_parse import lookup

if TYPE_CHECKING:
    from jaxhybrid.config import Config

# Myelin's all-reduce of the gradients over data replicas that are MPI ranks (IV-B, V-C); where they stream
# and where not is Trainer.overlap_note's.
REPLICA_KEYS = ("optim.allreduce_coarsening", "optim.stream_allreduce", "optim.allreduce_dtype")
PIPELINE_ENGINE_KEYS = ("pipeline.schedule", "pipeline.split_backward", "pipeline.pipeline_limit",
                        "pipeline.transport", "pipeline.dispatch", "pipeline.weight_join", "pipeline.watchdog_s",
                        "pipeline.watchdog_compile_s", "metrics.trace")


def unread_settings_notes(cfg: Config) -> list[str]:
    """One line per group of settings this run sets to other than their defaults (a default cannot be told
    from a key left out) but does not read."""
    from jaxhybrid.config import Config

    default = Config()
    return [n for n in (_pipeline_engine_note(cfg, default), _weight_join_note(cfg, default),
                        _replica_note(cfg, default)) if n]


def _set(cfg: Config, default: Config, keys: tuple[str, ...]) -> list[str]:
    return [f"{k}={lookup(cfg, k)}" for k in keys if lookup(cfg, k) != lookup(default, k)]


def _pipeline_engine_note(cfg: Config, default: Config) -> str | None:
    unread = _set(cfg, default, PIPELINE_ENGINE_KEYS) if cfg.world_size == 1 else []
    if not unread:
        return None
    engine = "one tensor mesh" if cfg.on_mesh else "the single-device engine"
    return (f"{', '.join(unread)} not used: only the MPI pipeline engine reads them (parallel.pipeline > 1, or "
            f"parallel.data > 1 as MPI ranks); this run is one process on {engine}")


def _weight_join_note(cfg: Config, default: Config) -> str | None:
    """2BP's deferred weight passes are what ``pipeline.weight_join`` joins (a one-process run's note names it)."""
    pl = cfg.pipeline
    if cfg.world_size == 1 or pl.split_backward or pl.weight_join == default.pipeline.weight_join:
        return None
    return (f"pipeline.weight_join={pl.weight_join} not used: it joins the weight passes that 2BP defers, and "
            f"pipeline.split_backward={pl.split_backward} runs none; set pipeline.split_backward=true or leave "
            f"weight_join out")


def _replica_note(cfg: Config, default: Config) -> str | None:
    if cfg.world_size > 1 and cfg.parallel.data > 1:
        return None
    unread = _set(cfg, default, REPLICA_KEYS)
    if not unread:
        return None
    mesh = " on one tensor mesh, reduced by XLA's collectives" if cfg.on_mesh else ""
    return (f"{', '.join(unread)} not used: they shape the all-reduce over data replicas that are MPI ranks, and "
            f"this run has none (parallel.data={cfg.parallel.data}{mesh})")
