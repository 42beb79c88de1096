"""The discrete-event core shared by the simulator, the 2BP generator and the validator.

A *policy* decides what a free rank runs next; the core keeps time, dependencies and messages:

* ``F(m, s)`` needs the output of ``F(m, s-1)``;
* ``B(m, s)`` / ``BI(m, s)`` need ``F(m, s)`` and the input gradient of ``B/BI(m, s+1)``;
* ``BW(ms, s)`` needs ``BI(m, s)`` for every ``m`` in ``ms``.

A dependency produced on another rank arrives ``Costs.message_time`` after it ends (latency + bytes /
bandwidth); on the same rank it is available when it ends. Decisions are taken in time order; since F
and BI take positive time, anything not yet started when a rank decides at time ``t`` ends after ``t``,
so a policy sees exactly what a real rank would have received by then.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.tasks import Kind, Task

Key = tuple[str, int, int]  # ("F" | "G" | "I", microbatch, stage): forward out, input grad, BI done


def dependencies(t: Task, num_stages: int) -> list[Key]:
    """Outputs that task ``t`` consumes (see module docstring)."""
    s = t.stage
    if t.kind is Kind.F:
        return [("F", t.microbatch, s - 1)] if s > 0 else []
    if t.kind in (Kind.B, Kind.BI):
        deps = [("F", t.microbatch, s)]
        return deps + ([("G", t.microbatch, s + 1)] if s < num_stages - 1 else [])
    return [("I", m, s) for m in t.microbatches]


def products(t: Task) -> list[Key]:
    if t.kind is Kind.F:
        return [("F", t.microbatch, t.stage)]
    if t.kind is Kind.B:
        return [("G", t.microbatch, t.stage)]
    if t.kind is Kind.BI:
        return [("G", t.microbatch, t.stage), ("I", t.microbatch, t.stage)]
    return []


@dataclass
class Record:
    rank: int
    task: Task
    start: float
    end: float


@dataclass
class Message:
    key: Key
    src: int
    dst: int
    send: float
    arrive: float


class Policy(Protocol):
    def choose(self, rank: int, t: float, sim: "Core") -> Task | None: ...
    def done(self, rank: int) -> bool: ...
    def blocked(self, rank: int) -> Task | None: ...


@dataclass
class Core:
    """Runs a policy to completion (or to a deadlock). See :func:`run`."""

    stage_to_rank: tuple[int, ...]
    num_ranks: int
    costs: Costs
    finish: dict[Key, float] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def _producer_rank(self, key: Key) -> int:
        return self.stage_to_rank[key[2]]

    def arrival(self, key: Key, rank: int) -> float | None:
        """When ``key`` is available on ``rank``; ``None`` if its producer has not started yet."""
        end = self.finish.get(key)
        if end is None:
            return None
        if self._producer_rank(key) == rank or key[0] == "I":
            return end
        boundary = key[2] if key[0] == "F" else key[2] - 1
        return end + self.costs.message_time(boundary)

    def ready_at(self, rank: int, t: Task) -> float | None:
        """Time when all inputs of ``t`` are on ``rank``; ``None`` while one is not yet produced."""
        latest = 0.0
        for key in dependencies(t, self.num_stages):
            a = self.arrival(key, rank)
            if a is None:
                return None
            latest = max(latest, a)
        return latest

    def missing(self, rank: int, t: Task) -> list[Key]:
        return [k for k in dependencies(t, self.num_stages) if k not in self.finish]

    def run(self, policy: Policy) -> list[int]:
        """Executes ``policy``; returns the ranks left unfinished (empty unless deadlocked)."""
        heap: list[tuple[float, int, int]] = [(0.0, r, r) for r in range(self.num_ranks)]
        seq = self.num_ranks
        free_at = [0.0] * self.num_ranks
        while heap:
            now, _, r = heapq.heappop(heap)
            if free_at[r] > now or policy.done(r):
                continue
            t = policy.choose(r, now, self)
            if t is None:
                continue  # woken again when an input is produced (below)
            if t.stage >= self.num_stages or self.stage_to_rank[t.stage] != r:
                raise ValueError(f"rank {r} runs task {t}, but stage {t.stage} belongs to rank "
                                 f"{self.stage_to_rank[t.stage] if t.stage < self.num_stages else '?'}")
            end = now + self.costs.duration(t)
            self.records.append(Record(r, t, now, end))
            free_at[r] = end
            heapq.heappush(heap, (end, seq, r))
            seq += 1
            for key in products(t):
                self.finish[key] = end
                for dst in self._consumers(key):
                    arrive = self.arrival(key, dst)
                    if dst != r:
                        self.messages.append(Message(key, r, dst, end, arrive))
                    heapq.heappush(heap, (arrive, seq, dst))
                    seq += 1
        return [r for r in range(self.num_ranks) if not policy.done(r)]

    def _consumers(self, key: Key) -> list[int]:
        kind, _, s = key
        if kind == "F" and s + 1 < self.num_stages:
            return [self.stage_to_rank[s + 1]]
        if kind == "G" and s > 0:
            return [self.stage_to_rank[s - 1]]
        return []


def describe_deadlock(core: Core, policy: Policy, stuck: list[int]) -> str:
    """One line per blocked rank: the task it waits at and the inputs nobody produced."""
    parts = []
    for r in stuck:
        t = policy.blocked(r)
        if t is None:
            parts.append(f"rank {r} cannot finish")
            continue
        miss = ", ".join(_key_str(k) for k in core.missing(r, t)) or "nothing (policy refused it)"
        parts.append(f"rank {r} blocked at task {t} waiting for {miss}")
    return "; ".join(parts)


def _key_str(k: Key) -> str:
    kind, m, s = k
    return {"F": f"the output of F{m}@s{s}", "G": f"the input gradient of B/BI{m}@s{s}",
            "I": f"BI{m}@s{s}"}[kind]


class StaticPolicy:
    """Executes each rank's row in order (a static schedule)."""

    def __init__(self, rows):
        self.rows = [list(r) for r in rows]
        self.pos = [0] * len(self.rows)

    def choose(self, rank: int, t: float, sim: Core) -> Task | None:
        nxt = self.rows[rank][self.pos[rank]]
        ready = sim.ready_at(rank, nxt)
        if ready is None or ready > t:
            return None
        self.pos[rank] += 1
        return nxt

    def done(self, rank: int) -> bool:
        return self.pos[rank] >= len(self.rows[rank])

    def blocked(self, rank: int) -> Task | None:
        return None if self.done(rank) else self.rows[rank][self.pos[rank]]
