"""jaxhybrid: hybrid-parallel transformer training in JAX (Myelin, 2BP, AxoNN 4D, MadPipe).

Public API (everything else is internal and may change):
  Config, ConfigError, load_config   -- typed run configuration
  ParallelDims                       -- the parallel layout: sizes, device and rank counts, rank arithmetic
  ModelConfig, Model, Ops, PRESETS   -- single-device model code with injected ops
  GradEngine, LocalEngine            -- the trainer/parallelism seam and the reference engine
  Task, Kind, Schedule               -- pipeline schedules as data

Names resolve lazily so that device-free commands (simulate, plan, partition) do not import JAX.
"""
import importlib

from jaxhybrid.core import __version__

_EXPORTS = {
    "Config": "jaxhybrid.core.config.schema", "ConfigError": "jaxhybrid.core.errors",
    "load_config": "jaxhybrid.runtime.config_load",
    "ParallelDims": "jaxhybrid.core.layout",
    "PRESETS": "jaxhybrid.core.config.model", "ModelConfig": "jaxhybrid.core.config.model",
    "Model": "jaxhybrid.model.transformer", "Ops": "jaxhybrid.model.layers",
    "GradEngine": "jaxhybrid.runtime.engines.base", "LocalEngine": "jaxhybrid.runtime.engines.base",
    "Task": "jaxhybrid.parallel.pipeline.tasks", "Kind": "jaxhybrid.parallel.pipeline.tasks", "Schedule": "jaxhybrid.parallel.pipeline.tasks",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxhybrid' has no attribute {name!r}")
