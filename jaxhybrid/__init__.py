"""jaxhybrid: hybrid-parallel transformer training in JAX (Myelin, 2BP, AxoNN 4D, MadPipe).

Public API (everything else is internal and may change):
  Config, ConfigError, load_config   -- typed run configuration
  ModelConfig, Model, Ops, PRESETS   -- single-device model code with injected ops
  GradEngine, LocalEngine            -- the trainer/parallelism seam and the reference engine
  Task, Kind, Schedule               -- pipeline schedules as data
"""
from jaxhybrid.config import Config, ConfigError, load_config
from jaxhybrid.model import PRESETS, Model, ModelConfig, Ops
from jaxhybrid.pipeline.tasks import Kind, Schedule, Task
from jaxhybrid.step import GradEngine, LocalEngine

__all__ = ["Config", "ConfigError", "load_config", "PRESETS", "Model", "ModelConfig", "Ops", "GradEngine",
           "LocalEngine", "Task", "Kind", "Schedule"]
__version__ = "0.1.0"
