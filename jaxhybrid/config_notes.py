"""Settings a run sets but does not read, named in a note when the run starts.

The pipeline section and ``metrics.trace`` belong to the MPI pipeline engine (``jaxhybrid.build``: a run of
more than one rank). A one-process run (the single-device engine, or one tensor mesh) has no schedule,
event loop, transport or watchdog, so it would drop them without a word: ``pipeline.split_backward=true``
would not split the backward and ``metrics.trace=true`` would write no trace. They are not config errors,
because a run config and a plan file set them for the layouts that read them, and a one-process override
of the layout (``--set parallel.pipeline=1``) should not have to reset them too. Likewise
``pipeline.weight_join`` in a pipeline without ``pipeline.split_backward`` (a plan may turn the split off).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxhybrid.config_parse import lookup

if TYPE_CHECKING:
    from jaxhybrid.config import Config

PIPELINE_ENGINE_KEYS = ("pipeline.schedule", "pipeline.split_backward", "pipeline.pipeline_limit",
                        "pipeline.transport", "pipeline.dispatch", "pipeline.weight_join", "pipeline.watchdog_s",
                        "pipeline.watchdog_compile_s", "metrics.trace")


def unread_settings_note(cfg: Config) -> str | None:
    """The settings this run sets to other than their defaults (a default cannot be told from a key left out)
    but does not read, or None: in a one-process run the pipeline engine's; in a pipeline run
    ``pipeline.weight_join`` without 2BP's split, whose deferred weight passes are what it joins."""
    from jaxhybrid.config import Config

    default = Config()
    if cfg.world_size > 1:
        pl = cfg.pipeline
        if pl.split_backward or pl.weight_join == default.pipeline.weight_join:
            return None
        return (f"pipeline.weight_join={pl.weight_join} not used: it joins the weight passes that 2BP defers, and "
                f"pipeline.split_backward={pl.split_backward} runs none; set pipeline.split_backward=true or leave "
                f"weight_join out")
    unread = [f"{k}={lookup(cfg, k)}" for k in PIPELINE_ENGINE_KEYS if lookup(cfg, k) != lookup(default, k)]
    if not unread:
        return None
    engine = "one tensor mesh" if cfg.on_mesh else "the single-device engine"
    return (f"{', '.join(unread)} not used: only the MPI pipeline engine reads them (parallel.pipeline > 1, or "
            f"parallel.data > 1 as MPI ranks); this run is one process on {engine}")
