"""Optimizers: AdamW with warmup+cosine, dynamic loss scaling, host offload, bucketed all-reduce."""
from jaxhybrid.optim.loss_scale import LossScale
from jaxhybrid.optim.updater import DeviceUpdater, build_transform, decay_mask, device_updater, lr_schedule

__all__ = ["LossScale", "DeviceUpdater", "build_transform", "decay_mask", "device_updater", "lr_schedule"]
