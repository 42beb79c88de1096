"""Dynamic rules run by :mod:`jaxhybrid.parallel.pipeline.simcore`: 2BP's delayed weight gradient and Myelin's
message-driven policy.

2BP (Sec. 3.2, Fig. 1): a rank whose next F/BI cannot start yet runs one pending BW (the oldest) instead
of idling; the BWs still pending after its last BI run at the end, concatenated along the batch into one
BW task per stage (Fig. 2). The memory-saving variant of Fig. 5 also flushes the pending BWs (one
concatenated task) right after every ``flush_every``-th BI of a stage, e.g. half-way through 1F1B-2.

Myelin Algorithm 2: the first stage injects ``pipeline_limit`` forwards (lines 4-6) and one more after
each of its backward passes (lines 24-26); the last stage runs its backward right after its forward
(lines 15-17); every other step handles the earliest arrived message (line 12). Ties between messages
that arrive at the same instant go to the backward one (it frees memory), then to the lower microbatch.
With 2BP its weight passes follow the engine (:mod:`~jaxhybrid.parallel.pipeline.message_driven`): one fills idle
time, and one runs right after a BI that leaves ``weight_budget`` of them pending (the memory bound).

ZB-V (Qi et al., zero-bubble pipelines with the V-shape placement): :class:`ZeroBubbleVPolicy` builds its rows by
list scheduling under a cap on the activations each rank holds.
"""
from __future__ import annotations

import collections

from jaxhybrid.parallel.pipeline.generators import rank_stages
from jaxhybrid.parallel.pipeline.simcore import Core
from jaxhybrid.parallel.pipeline.tasks import Kind, Task, task


class _BWQueue:
    """Per-rank pending weight gradients (microbatch, stage) in BI order, and the executed order."""

    def __init__(self, num_ranks: int):
        self.pending = [[] for _ in range(num_ranks)]
        self.forced = [collections.deque() for _ in range(num_ranks)]
        self.order = [[] for _ in range(num_ranks)]

    def add(self, rank: int, t: Task) -> None:
        self.pending[rank].append((t.microbatch, t.stage))

    def pop_single(self, rank: int) -> Task:
        m, s = self.pending[rank].pop(0)
        return task(Kind.BW, m, s)

    def flush(self, rank: int, stage: int | None = None) -> None:
        """Queue one concatenated BW per stage (of ``stage`` only when given) of the pending ones."""
        stages = sorted({s for _, s in self.pending[rank]}) if stage is None else [stage]
        for s in stages:
            mbs = tuple(m for m, st in self.pending[rank] if st == s)
            if mbs:
                self.forced[rank].append(task(Kind.BW, mbs, s))
        keep = set(stages)
        self.pending[rank] = [(m, s) for m, s in self.pending[rank] if s not in keep]

    def emit(self, rank: int, t: Task) -> Task:
        self.order[rank].append(t)
        return t


class FillPolicy:
    """2BP: execute base rows of F and BI tasks, placing BWs in idle time and at the end.

    Args:
      rows: per-rank F/BI (no BW) tasks in execution order.
      fill_idle: run a pending BW when the next task is not ready (2BP's 1F1B); False keeps every BW
        to the end (2BP's GPipe, Sec. 3.2).
      flush_every: flush the pending BWs of a stage after every ``flush_every``-th BI of it (Fig. 5).
    """

    def __init__(self, rows, fill_idle: bool = True, flush_every: int | None = None):
        self.rows = [list(r) for r in rows]
        self.pos = [0] * len(self.rows)
        self.fill_idle = fill_idle
        self.flush_every = flush_every
        self.bw = _BWQueue(len(self.rows))
        self.bi_count: collections.Counter = collections.Counter()

    @property
    def order(self) -> list[list[Task]]:
        return self.bw.order

    def choose(self, rank: int, t: float, sim: Core) -> Task | None:
        q = self.bw
        if q.forced[rank]:
            return q.emit(rank, q.forced[rank].popleft())
        row = self.rows[rank]
        if self.pos[rank] < len(row):
            nxt = row[self.pos[rank]]
            ready = sim.ready_at(rank, nxt)
            if ready is not None and ready <= t:
                self.pos[rank] += 1
                if nxt.kind is Kind.BI:
                    q.add(rank, nxt)
                    self.bi_count[rank, nxt.stage] += 1
                    if self.flush_every and self.bi_count[rank, nxt.stage] % self.flush_every == 0:
                        q.flush(rank, nxt.stage)
                return q.emit(rank, nxt)
            if self.fill_idle and q.pending[rank]:
                return q.emit(rank, q.pop_single(rank))
            return None
        if q.pending[rank]:
            q.flush(rank)
            return q.emit(rank, q.forced[rank].popleft())
        return None

    def done(self, rank: int) -> bool:
        return (self.pos[rank] >= len(self.rows[rank]) and not self.bw.pending[rank]
                and not self.bw.forced[rank])

    def blocked(self, rank: int) -> Task | None:
        return None if self.pos[rank] >= len(self.rows[rank]) else self.rows[rank][self.pos[rank]]


class MessageDrivenPolicy:
    """Myelin Algorithm 2 over per-rank pools of F and B (or BI) tasks; BWs follow the 2BP rule.

    Args:
      rows: per-rank tasks; BW entries are ignored (the rule places them), F/B/BI form the pools.
      stage_to_rank: rank of each stage.
      pipeline_limit: microbatches injected before the first backward (Myelin V-A: ``G_inter``).
      weight_budget: 2BP: a rank holding this many microbatches' weight residuals after a BI runs the
        oldest one's BW at once (before anything else, as the engine does); 0 means the engine's
        default, the number of stages.
    """

    def __init__(self, rows, stage_to_rank, pipeline_limit: int, weight_budget: int = 0):
        nstages = len(stage_to_rank)
        self.weight_budget = weight_budget or nstages
        if self.weight_budget < 1:
            raise ValueError(f"weight_budget={weight_budget} must be >= 1 (0 means: stages)")
        self.last = nstages - 1
        rank0 = stage_to_rank[0]
        injections = sorted((t for t in rows[rank0] if t.kind is Kind.F and t.stage == 0), key=lambda t: t.microbatch)
        self.inject = collections.deque(injections)
        # Per rank, the pool by microbatch, lowest first: a choice scans only the microbatches stage 0 has
        # injected (no other task can be ready), so it costs the in-flight window, not the whole pool.
        self.pool, injected = [], set(injections)
        for row in rows:
            by_mb: dict[int, list[Task]] = {}
            for t in sorted((t for t in row if t.kind is not Kind.BW and t not in injected),
                            key=lambda t: t.microbatch):
                by_mb.setdefault(t.microbatch, []).append(t)
            self.pool.append(by_mb)
        self.priority = [collections.deque() for _ in rows]
        for _ in range(min(pipeline_limit, len(self.inject))):
            self.priority[rank0].append(self.inject.popleft())
        self.rank0 = rank0
        self.bw = _BWQueue(len(rows))

    @property
    def order(self) -> list[list[Task]]:
        return self.bw.order

    def _take(self, rank: int, t: Task) -> None:
        tasks = self.pool[rank].get(t.microbatch, ())
        if t in tasks:
            tasks.remove(t)
            if not tasks:
                del self.pool[rank][t.microbatch]

    def _started(self, rank: int, t: Task) -> Task:
        self._take(rank, t)
        if t.kind is Kind.BI:
            self.bw.add(rank, t)
            # Memory bound, before the injection below: the engine pays this BW inside its backward step.
            if len(self.bw.pending[rank]) >= self.weight_budget:
                self.bw.forced[rank].append(self.bw.pop_single(rank))
        if t.kind is Kind.F and t.stage == self.last:
            back = next((b for b in self.pool[rank].get(t.microbatch, ()) if b.kind in (Kind.B, Kind.BI)
                         and b.stage == self.last), None)
            if back is not None:  # Alg. 2 lines 15-17: the loss stage turns straight around
                self._take(rank, back)
                self.priority[rank].appendleft(back)
        if t.kind in (Kind.B, Kind.BI) and t.stage == 0 and self.inject:
            self.priority[self.rank0].append(self.inject.popleft())  # Alg. 2 lines 24-26
        return self.bw.emit(rank, t)

    def choose(self, rank: int, t: float, sim: Core) -> Task | None:
        if self.bw.forced[rank]:
            return self.bw.emit(rank, self.bw.forced[rank].popleft())
        if self.priority[rank]:
            return self._started(rank, self.priority[rank].popleft())
        best, best_key = None, None
        horizon = self.inject[0].microbatch if self.inject else None  # no task of it or later can be ready
        for mb, tasks in self.pool[rank].items():
            if horizon is not None and mb >= horizon:
                break
            for cand in tasks:
                ready = sim.ready_at(rank, cand)
                if ready is None or ready > t:
                    continue
                key = (ready, cand.kind is Kind.F, mb, cand.stage)
                if best_key is None or key < best_key:
                    best, best_key = cand, key
        if best is not None:
            return self._started(rank, best)
        if self.bw.pending[rank]:
            if self.pool[rank] or (rank == self.rank0 and self.inject):
                return self.bw.emit(rank, self.bw.pop_single(rank))  # 2BP: fill idle time
            self.bw.flush(rank)  # nothing left but weight gradients: one concatenated BW per stage
            return self.bw.emit(rank, self.bw.forced[rank].popleft())
        return None

    def done(self, rank: int) -> bool:
        return not (self.pool[rank] or self.priority[rank] or self.bw.pending[rank]
                    or self.bw.forced[rank] or (rank == self.rank0 and self.inject))

    def blocked(self, rank: int) -> Task | None:
        if self.priority[rank]:
            return self.priority[rank][0]
        return next(iter(self.pool[rank].values()))[0] if self.pool[rank] else None


class ZeroBubbleVPolicy:
    """ZB-V's order by greedy list scheduling (Qi et al., "Pipeline Parallelism with Controllable Memory",
    the V-shape building block: two chunks per rank, stages ``r`` and ``2p - 1 - r``, always split backward).

    A free rank runs, by priority: a ready BI (it unblocks the ranks upstream), else a ready F if the chunk
    activations it then holds stay within ``limit`` (a chunk's held from the start of its F to the end of its
    BW, as the simulator counts them), else its oldest pending BW (fills the bubble, frees memory), else it
    waits for the next message. Among ready tasks the lowest microbatch wins, then the later stage (the
    microbatch nearer the loss). ``limit = 2p`` chunks is 1F1B's peak, ``p`` microbatches of a whole rank.

    Args:
      stage_to_rank: rank of each stage.
      microbatches: microbatches per step.
      limit: chunk activations a rank may hold.
    """

    def __init__(self, stage_to_rank, microbatches: int, limit: int):
        self.limit, self.microbatches = limit, microbatches
        self.stages = rank_stages(stage_to_rank)
        ranks = len(self.stages)
        # A stage's F and BI become ready in microbatch order (its inputs do, by induction from stage 0, whose
        # forwards are all ready and taken lowest first), so only each stage's next one is a candidate.
        self.next = {(s, kind): 0 for s in range(len(stage_to_rank)) for kind in (Kind.F, Kind.BI)}
        self.held = [0] * ranks
        self.bw = _BWQueue(ranks)

    @property
    def order(self) -> list[list[Task]]:
        return self.bw.order

    def _ready(self, rank: int, kind: Kind, t: float, sim: Core) -> Task | None:
        best = None
        for s in self.stages[rank]:
            m = self.next[s, kind]
            if m >= self.microbatches or (best is not None and (best.microbatch, -best.stage) < (m, -s)):
                continue
            cand = task(kind, m, s)
            ready = sim.ready_at(rank, cand)
            if ready is not None and ready <= t:
                best = cand
        return best

    def choose(self, rank: int, t: float, sim: Core) -> Task | None:
        pick = self._ready(rank, Kind.BI, t, sim)
        if pick is None and self.held[rank] < self.limit:
            pick = self._ready(rank, Kind.F, t, sim)
            if pick is not None and pick.stage != self.stages[rank][-1] and self.held[rank] + 1 >= self.limit \
                    and self._upper_due(rank) and not self.bw.pending[rank]:
                # The last slot goes to the upper chunk: filled by lower-chunk forwards while a microbatch is
                # on its way back up the V, with no weight pass left to free one, the rank could never run
                # that microbatch's upper F, nor its BI (a deadlock whenever messages take time).
                pick = None
        if pick is not None:
            self.next[pick.stage, pick.kind] += 1
            if pick.kind is Kind.BI:
                self.bw.add(rank, pick)
            else:
                self.held[rank] += 1
            return self.bw.emit(rank, pick)
        if self.bw.pending[rank]:
            self.held[rank] -= 1  # freed when this BW ends; the rank decides nothing before then
            return self.bw.emit(rank, self.bw.pop_single(rank))
        return None

    def _upper_due(self, rank: int) -> bool:
        """Whether a microbatch whose lower-chunk F ran here still owes this rank its upper-chunk F."""
        lower, upper = self.stages[rank][0], self.stages[rank][-1]
        return self.next[upper, Kind.F] < self.next[lower, Kind.F]

    def _left(self, rank: int) -> list[Task]:
        return [task(kind, m, s) for s in self.stages[rank] for kind in (Kind.F, Kind.BI)
                for m in [self.next[s, kind]] if m < self.microbatches]

    def done(self, rank: int) -> bool:
        return not (self._left(rank) or self.bw.pending[rank])

    def blocked(self, rank: int) -> Task | None:
        left = self._left(rank)
        return min(left, key=lambda t: (t.microbatch, -t.stage, t.kind is Kind.F)) if left else None
