"""Single-device model code: configs and presets, layers with injected ops, the block-list decoder."""
from jaxhybrid.core.config.model import PRESETS, ModelConfig, resolve_model
from jaxhybrid.model.layers import DEFAULT_OPS, Ops
from jaxhybrid.model.transformer import Model, block_name, compiled_init, remat_policy

__all__ = ["PRESETS", "ModelConfig", "resolve_model", "DEFAULT_OPS", "Ops", "Model", "block_name", "compiled_init", "remat_policy"]
