"""The stop for a run whose steps stay non-finite: skipped steps in a row, or a skip at the loss scale's floor.

A skipped step (non-finite gradients, agreed over ranks by ``engine.global_max``) leaves the parameters
as they were and halves a dynamic loss scale (Micikevicius et al., mixed-precision training, Sec. 3.2).
Past its floor nothing is left to back off, and a float32 run has no scale to back off at all, so a run
that keeps skipping only burns time and, saved, would hand a resume the same state. Every rank sees the
same agreed flags and scales, so every rank stops at the same step without another collective (as
Megatron-LM stops on a NaN gradient and DeepSpeed's scaler at its minimum).
"""
from __future__ import annotations

import math

from jaxhybrid.optim.loss_scale import LossScale


class NonFiniteStop(RuntimeError):
    """Training stopped on non-finite steps; the message names the step, the last finite loss and what to try."""


class NonFiniteGuard:
    """Counts consecutive skipped steps; :meth:`observe` returns the stop message once the run should stop.

    Args:
      limit: ``train.max_nonfinite_steps``: skipped steps in a row that stop the run; 0 turns the guard off
        (the floor rule included).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.streak = 0  # skipped steps in a row, up to the last observed
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the last step that updated

    def observe(self, step: int, info: dict, scale: LossScale) -> str | None:
        """Record logged step ``step`` (``info`` as :meth:`Trainer.step` returns it; ``scale`` the loss scale
        that step used, before its update). A message when the run must stop, else None."""
        if not info["skipped"]:
            self.streak = 0
            if math.isfinite(info["loss"]):
                self.last_finite = (step, info["loss"])
            return None
        self.streak += 1
        if not self.limit:
            return None
        at_floor = scale.dynamic and scale.scale <= scale.min_scale
        if self.streak < self.limit and not at_floor:
            return None
        why = (f"the loss scale is at its floor {scale.min_scale:g} and the step still overflowed" if at_floor else
               f"train.max_nonfinite_steps={self.limit} steps in a row had non-finite gradients")
        last = (f"the last finite loss was {self.last_finite[1]:.4g} at step {self.last_finite[0]}" if self.last_finite
                else "no step of this run updated the parameters")
        return (f"stopped at step {step}: {why} ({self.streak} skipped; {last}); nothing of this state was saved. "
                f"Try a lower optim.lr, optim.warmup_steps > 0, optim.grad_clip > 0, precision.compute_dtype="
                f"bfloat16 or float32, or a resume from an earlier checkpoint (train.max_nonfinite_steps=0 turns "
                f"this stop off)")
