"""jaxhybrid: hybrid-parallel transformer training in JAX (Myelin, 2BP, AxoNN 4D, MadPipe).

Public API (everything else is internal and may change):
  Config, ConfigError, load_config   -- typed run configuration
  ModelConfig, Model, Ops, PRESETS   -- single-device model code with injected ops
  GradEngine, LocalEngine            -- the trainer/parallelism seam and the reference engine
  Task, Kind, Schedule               -- pipeline schedules as data

Names resolve lazily so that device-free commands (simulate, plan, partition) do not import JAX.
"""
import importlib

_EXPORTS = {
    "Config": "jaxhybrid.config", "ConfigError": "jaxhybrid.config", "load_config": "jaxhybrid.config",
    "PRESETS": "jaxhybrid.model.config", "ModelConfig": "jaxhybrid.model.config",
    "Model": "jaxhybrid.model.transformer", "Ops": "jaxhybrid.model.layers",
    "GradEngine": "jaxhybrid.step", "LocalEngine": "jaxhybrid.step",
    "Task": "jaxhybrid.pipeline.tasks", "Kind": "jaxhybrid.pipeline.tasks", "Schedule": "jaxhybrid.pipeline.tasks",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxhybrid' has no attribute {name!r}")
