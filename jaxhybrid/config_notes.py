"""Settings a run's engine does not read, named in a note when the run starts.

The pipeline section and ``metrics.trace`` belong to the MPI pipeline engine (``jaxhybrid.build``: a run of
more than one rank). A one-process run (the single-device engine, or one tensor mesh) has no schedule,
event loop, transport or watchdog, so it would drop them without a word: ``pipeline.split_backward=true``
would not split the backward and ``metrics.trace=true`` would write no trace. They are not config errors,
because a run config and a plan file set them for the layouts that read them, and a one-process override
of the layout (``--set parallel.pipeline=1``) should not have to reset them too.
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
    """The pipeline engine's settings that a one-process run sets to other than their defaults (a default
    cannot be told from a key left out), or None."""
    if cfg.world_size > 1:
        return None
    from jaxhybrid.config import Config

    unread = [f"{k}={lookup(cfg, k)}" for k in PIPELINE_ENGINE_KEYS if lookup(cfg, k) != lookup(Config(), k)]
    if not unread:
        return None
    engine = "one tensor mesh" if cfg.on_mesh else "the single-device engine"
    return (f"{', '.join(unread)} not used: only the MPI pipeline engine reads them (parallel.pipeline > 1, or "
            f"parallel.data > 1 as MPI ranks); this run is one process on {engine}")
