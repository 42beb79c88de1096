"""The vocabulary of schedules: frozen tasks in per-rank rows (schedules are data).

A :class:`Task` names what one rank does next: a forward (``F``), a fused backward (``B``), a 2BP
input-gradient pass (``BI``, backward-p1) or a weight-gradient pass (``BW``, backward-p2) that may cover
several microbatches at once (2BP Fig. 2: concatenated along the batch). ``stage`` is the logical
pipeline stage; which rank runs it is given by :attr:`Schedule.stage_to_rank`, kept distinct so that
non-contiguous and interleaved allocations can be expressed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class Task:
    """One unit of work. ``microbatches`` has one entry except for a concatenated ``BW``."""

    kind: Kind
    microbatches: tuple[int, ...]
    stage: int

    @property
    def microbatch(self) -> int:
        """The single microbatch of an F/B/BI task (the first one of a concatenated BW)."""
        return self.microbatches[0]

    def __str__(self) -> str:
        mbs = "+".join(str(m) for m in self.microbatches)
        return f"{self.kind.value}{mbs}@s{self.stage}"


def task(kind: str | Kind, microbatch: int | tuple[int, ...], stage: int) -> Task:
    mbs = (microbatch,) if isinstance(microbatch, int) else tuple(microbatch)
    return Task(Kind(kind), mbs, stage)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered task lists for one training step.

    Attributes:
      name: generator name, e.g. ``"1f1b"``.
      rows: ``rows[r]`` is the ordered tasks of rank ``r``.
      stage_to_rank: ``stage_to_rank[s]`` is the rank running logical stage ``s``.
      num_microbatches: microbatches per step (per data replica).
      split_backward: True if backward work is BI + BW (2BP), False if fused B.
      policy: ``"static"`` (execute rows in order) or ``"message-driven"`` (Myelin Alg. 2: the rows
        list the work; the engine picks the next ready task by arriving messages, at most
        ``pipeline_limit`` microbatches in flight).
    """

    name: str
    rows: tuple[tuple[Task, ...], ...]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    split_backward: bool = False
    policy: str = "static"
    pipeline_limit: int = 0

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def grads_final(self, rank: int) -> tuple[int, ...]:
        """Rank ``rank``'s stages in the order its row completes their gradients (each stage's last ``B``,
        or with 2BP its last ``BW``): the order every replica of the rank starts their data-parallel
        reductions in, whatever order a message-driven loop happens to finish them."""
        last = {t.stage: i for i, t in enumerate(self.rows[rank]) if t.kind in (Kind.B, Kind.BW)}
        return tuple(sorted(last, key=last.__getitem__))

    def table(self) -> str:
        """A plain-text table, one line per rank (used for golden files)."""
        return "\n".join(f"rank {r}: " + " ".join(str(t) for t in row) for r, row in enumerate(self.rows))
