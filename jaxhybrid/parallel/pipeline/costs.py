"""Per-stage task costs, message costs and per-task memory for the schedule simulator.

Time is in seconds when the costs are measured, or in abstract units (2BP Table 1 uses F = BI = BW = 1).
Memory follows 2BP Sec. 4.2: a forward pass stashes ``activation_bytes`` until the backward pass of the
same microbatch; with 2BP the input-gradient pass (BI, backward-p1) releases them and keeps
``residual_bytes`` (the intermediate derivatives and the inputs the weight gradient needs) until the
weight-gradient pass (BW, backward-p2) covering that microbatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from jaxhybrid.parallel.pipeline.tasks import Kind, Task


def _per_stage(name: str, value, stages: int) -> tuple[float, ...]:
    vals = tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * stages
    if len(vals) != stages:
        raise ValueError(f"costs.{name} has {len(vals)} entries for {stages} stages; give one per stage")
    # An infinite cost or size has no schedule: the simulator would report makespan=inf and NaN idle times.
    if not all(0 <= v < math.inf for v in vals):
        raise ValueError(f"costs.{name} = {vals} has a negative, infinite or NaN entry; costs must be finite "
                         f"and >= 0")
    return vals


@dataclass(frozen=True)
class Costs:
    """Costs of one pipeline step, per logical stage (index = stage).

    Attributes:
      forward, backward_input, backward_weight: seconds (or units) of F, BI and BW for one microbatch.
      backward: fused B per microbatch; ``None`` means ``backward_input + backward_weight``.
      activation_bytes: bytes a stage stashes per microbatch from its F until its B / BI.
      residual_bytes: bytes a stage keeps per microbatch from its BI until its BW.
      message_bytes: bytes of the activation sent across boundary ``s -> s+1`` (the gradient sent back
        has the same size); one entry per stage, the last one unused.
      latency: seconds per point-to-point message between different ranks.
      bandwidth: bytes per second of a point-to-point link (``inf``: size does not matter).
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    backward: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    residual_bytes: tuple[float, ...] | None = None
    message_bytes: tuple[float, ...] | None = None
    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self):
        n = len(self.forward)
        for name in ("forward", "backward_input", "backward_weight", "backward", "activation_bytes",
                     "residual_bytes", "message_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _per_stage(name, value, n))
        for name in ("forward", "backward_input"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"costs.{name} = {getattr(self, name)}: F and BI costs must be > 0 "
                                 "(a zero-length pass on the critical path has no defined order)")
        # bandwidth may be inf (a message's size costs nothing); an infinite or NaN latency times nothing.
        if not 0 <= self.latency < math.inf or not self.bandwidth > 0:
            raise ValueError(f"latency={self.latency} must be finite and >= 0 and bandwidth={self.bandwidth} > 0")

    @classmethod
    def uniform(cls, stages: int, f: float = 1.0, bi: float = 1.0, bw: float = 1.0, *,
                b: float | None = None, activation_bytes: float = 1.0, residual_bytes: float | None = None,
                message_bytes: float = 0.0, latency: float = 0.0, bandwidth: float = math.inf) -> "Costs":
        """The same costs on every stage (2BP Table 1: ``f = bi = bw``)."""
        if stages < 1:
            raise ValueError(f"stages={stages} must be >= 1")
        return cls((f,) * stages, (bi,) * stages, (bw,) * stages, None if b is None else (b,) * stages,
                   (activation_bytes,) * stages,
                   None if residual_bytes is None else (residual_bytes,) * stages,
                   (message_bytes,) * stages, latency, bandwidth)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def fused_backward(self, stage: int) -> float:
        return self.backward[stage] if self.backward is not None else (
            self.backward_input[stage] + self.backward_weight[stage])

    def duration(self, t: Task) -> float:
        """Compute time of ``t``; a concatenated BW costs the sum over its microbatches (2BP Fig. 2)."""
        s = t.stage
        if t.kind is Kind.F:
            return self.forward[s]
        if t.kind is Kind.B:
            return self.fused_backward(s)
        if t.kind is Kind.BI:
            return self.backward_input[s]
        return self.backward_weight[s] * len(t.microbatches)

    def message_time(self, boundary: int) -> float:
        """Latency + bytes / bandwidth of the message across boundary ``boundary -> boundary + 1``."""
        nbytes = self.message_bytes[boundary] if self.message_bytes is not None else 0.0
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)

    def act_bytes(self, stage: int) -> float:
        return self.activation_bytes[stage] if self.activation_bytes is not None else 1.0

    def resid_bytes(self, stage: int) -> float:
        return self.residual_bytes[stage] if self.residual_bytes is not None else self.act_bytes(stage)


def parse_costs(text: str, stages: int, **kw) -> Costs:
    """``"F,BI,BW"`` (the CLI's ``--costs``) -> uniform :class:`Costs`; fused B costs BI + BW."""
    try:
        vals: Sequence[float] = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--costs {text!r}: expected three numbers F,B,W (e.g. 1,1,1)") from None
    if len(vals) != 3:
        raise ValueError(f"--costs {text!r}: expected three numbers F,B,W (forward, input-gradient, "
                         f"weight-gradient), got {len(vals)}")
    return Costs.uniform(stages, vals[0], vals[1], vals[2], **kw)
