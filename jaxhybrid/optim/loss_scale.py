"""Dynamic loss scaling (Micikevicius et al., mixed-precision training; Myelin Sec. V-B).

Pure and host-side: the decision is made once per step from an overflow flag that every rank agreed
on (``engine.global_max``), so all ranks skip or apply the same steps and keep identical scales.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LossScale:
    """Scale state. ``dynamic=False`` keeps ``scale`` fixed (1.0 for float32/bfloat16 by default).

    On overflow the step is skipped and the scale halves; after ``window`` finite steps in a row it
    doubles (capped at 2**24 so a long fp32 run cannot overflow the scale itself).
    """

    scale: float = 1.0
    good_steps: int = 0
    window: int = 1000
    dynamic: bool = False
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def update(self, finite: bool) -> "LossScale":
        if not self.dynamic:
            return self
        if not finite:
            return replace(self, scale=max(self.scale / 2.0, self.min_scale), good_steps=0)
        good = self.good_steps + 1
        if good >= self.window:
            return replace(self, scale=min(self.scale * 2.0, self.max_scale), good_steps=0)
        return replace(self, good_steps=good)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, d: dict) -> "LossScale":
        """The saved scale, where the saved run scaled as this one does. A resume may change the compute
        dtype: a static run (float32, bfloat16) keeps its fixed 1.0 whatever was saved (a float16 run's
        32768 would stay fixed, never halving on overflow), and a dynamic run resumed from a static one
        starts at ``precision.loss_scale_init`` (the saved 1.0 would leave float16 gradients unscaled, one
        doubling per ``loss_scale_window`` steps). Checkpoints written before ``dynamic`` was saved: a
        static run's state is scale 1.0 with no good steps counted."""
        saved_dynamic = d.get("dynamic")
        if saved_dynamic is None:
            saved_dynamic = not (float(d["scale"]) == 1.0 and int(d["good_steps"]) == 0)
        if not self.dynamic or not saved_dynamic:
            return self
        return replace(self, scale=float(d["scale"]), good_steps=int(d["good_steps"]))


def from_config(precision) -> LossScale:
    dynamic = precision.dynamic_loss_scale
    if dynamic is None:
        dynamic = precision.compute_dtype == "float16"
    return LossScale(scale=precision.loss_scale_init if dynamic else 1.0, window=precision.loss_scale_window,
                     dynamic=bool(dynamic))
