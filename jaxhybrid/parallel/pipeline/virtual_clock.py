"""The real event loop (:mod:`~jaxhybrid.parallel.pipeline.event_loop`) run on a virtual clock, to hold the simulator to it.

On real threads the message-driven policy's choices (Myelin Alg. 2: which message came first; 2BP: is
there idle time for a weight pass) depend on wall-clock timing, so the engine's order and the memory it
holds vary from run to run. Here each rank's unchanged ``EventLoop`` runs on its own thread, but one at a
time, as a conservative discrete-event simulation: the rank with the earliest virtual time goes next; a
stage call advances its rank's clock by the task's :class:`~jaxhybrid.parallel.pipeline.costs.Costs` duration; a
message arrives ``Costs.message_time`` after its send; ``poll`` returns only messages arrived by the
rank's virtual time. Messages arriving at the same instant come gradient first, then by microbatch
(the simulator's tie rule, :mod:`~jaxhybrid.parallel.pipeline.policies`). With F and BI costs > 0 nothing a rank
has not yet received can arrive at or before its time, so the loop sees what the simulator's
:class:`~jaxhybrid.parallel.pipeline.simcore.Core` lets a policy see, and the two must agree task for task.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.event_loop import EventLoop, loop_policy
from jaxhybrid.parallel.pipeline.transport import Envelope, Message, MsgKind


class VirtualClock:
    """Virtual time, mailboxes and turns of ``costs.num_stages`` ranks (rank = stage)."""

    def __init__(self, costs: Costs, timeout_s: float = 120.0):
        n = costs.num_stages
        self.costs, self.n, self.timeout_s = costs, n, timeout_s
        self.now = [0.0] * n
        self.inbox: list[list[tuple[tuple, Message]]] = [[] for _ in range(n)]
        self.parked: dict[int, bool] = {}  # rank -> waiting for a message (else: for its turn)
        self.done: set[int] = set()
        self.idle = [False] * n  # a poll found nothing since the rank's last task: the next one waits
        self.cv = threading.Condition()

    def _due(self, r: int) -> float:
        if not self.parked[r]:
            return self.now[r]
        return max(self.now[r], min((key[0] for key, _ in self.inbox[r]), default=math.inf))

    def _next(self) -> int | None:
        """The rank whose turn it is once every rank is parked or done; None while one still runs."""
        if not self.parked or len(self.parked) + len(self.done) < self.n:
            return None
        r = min(self.parked, key=lambda q: (self._due(q), q))
        if math.isinf(self._due(r)):
            raise RuntimeError(f"virtual clock: ranks {sorted(self.parked)} all wait for messages nobody sends")
        return r

    def _turn(self, r: int, blocked: bool) -> None:
        """Park rank ``r`` until it is the earliest (the caller holds ``self.cv``)."""
        self.parked[r] = blocked
        self.cv.notify_all()
        if not self.cv.wait_for(lambda: self._next() == r, timeout=self.timeout_s):
            raise TimeoutError(f"virtual clock: rank {r} got no turn in {self.timeout_s} s")
        self.now[r] = self._due(r)
        del self.parked[r]

    def compute(self, r: int, seconds: float) -> None:
        """Rank ``r`` starts a task of ``seconds``: it runs when no rank is earlier; then its clock moves on
        (its sends then leave at the task's end, as in the simulator)."""
        with self.cv:
            self._turn(r, blocked=False)
            self.now[r] += seconds
            self.idle[r] = False

    def finish(self, r: int) -> None:
        with self.cv:
            self.parked.pop(r, None)
            self.done.add(r)
            self.cv.notify_all()

    def send(self, r: int, x: Any, dest: int, env: Envelope) -> None:
        boundary = env.stage - 1 if env.kind is MsgKind.ACT else env.stage
        key = (self.now[r] + self.costs.message_time(boundary), env.kind is MsgKind.ACT, env.microbatch)
        with self.cv:
            self.inbox[dest].append((key, Message(env, r, x)))

    def poll(self, r: int) -> Message | None:
        """The earliest message arrived by rank ``r``'s time; a second poll with nothing in between (the
        loop blocks in ``wait_message``) waits, in virtual time, for the next arrival."""
        with self.cv:
            self._turn(r, blocked=self.idle[r])
            ready = [item for item in self.inbox[r] if item[0][0] <= self.now[r]]
            if not ready:
                self.idle[r] = True
                return None
            item = min(ready, key=lambda it: it[0])
            self.inbox[r].remove(item)
            self.idle[r] = False
            return item[1]


class ClockedTransport:
    """Rank ``rank``'s :class:`~jaxhybrid.parallel.pipeline.transport.Transport` on the clock."""

    def __init__(self, clock: VirtualClock, rank: int):
        self.clock, self.rank = clock, rank

    def send(self, x, dest: int, envelope: Envelope) -> None:
        self.clock.send(self.rank, x, dest, envelope)

    def poll(self) -> Message | None:
        return self.clock.poll(self.rank)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class Joined:
    """Several microbatches' weight residuals in one weight pass (its cost counts them, 2BP Fig. 2)."""

    def __init__(self, count: int, payload: Any):
        self.count, self.payload = count, payload


def clocked_join(join: Callable[[Any, list[Any]], Any]) -> Callable[[Any, list[Any]], Joined]:
    """``EventLoop(join=...)`` for :class:`ClockedStage`: ``join`` applied to the wrapped stage."""
    return lambda stage, parts: Joined(len(parts), join(stage.inner, parts))


class ClockedStage:
    """A stage whose passes take ``costs``' virtual time on stage ``s`` (rank ``s``). ``probe(n)`` is called
    as a pass starts, with the microbatches the pass itself holds (its input residuals, or the one an F
    makes): the loop's stored residuals plus ``n`` is what the rank holds while the pass runs."""

    def __init__(self, clock: VirtualClock, s: int, inner: Any, probe: Callable[[int], None] = lambda n: None):
        self.clock, self.s, self.inner, self.probe = clock, s, inner, probe

    def _start(self, seconds: float, held: int) -> None:
        self.probe(held)
        self.clock.compute(self.s, seconds)

    def forward(self, params, x, targets):
        self._start(self.clock.costs.forward[self.s], 1)
        return self.inner.forward(params, x, targets)

    def backward(self, res, dy, acc):
        self._start(self.clock.costs.fused_backward(self.s), 1)
        return self.inner.backward(res, dy, acc)

    def backward_input(self, res, dy):
        self._start(self.clock.costs.backward_input[self.s], 1)
        return self.inner.backward_input(res, dy)

    def backward_weight(self, params, wres, acc):
        k, wres = (wres.count, wres.payload) if isinstance(wres, Joined) else (1, wres)
        self._start(self.clock.costs.backward_weight[self.s] * k, k)
        return self.inner.backward_weight(params, wres, acc)


def run_engine(schedule, costs: Costs, stages: list[Any], params: list[Any], tokens, cotangent: float,
               weight_budget: int = 0, join: Callable[[Any, list[Any]], Any] = lambda stage, parts: list(parts),
               synced: bool = False):
    """One step of ``schedule`` by the real :class:`~jaxhybrid.parallel.pipeline.event_loop.EventLoop` of every rank on
    the clock (``stages[s]`` runs stage ``s`` on rank ``s``). Returns the ranks' ``StepResult``, the
    order each ran (``EventLoop.order``: :class:`~jaxhybrid.parallel.pipeline.tasks.Task` lists) and the most
    microbatches each held at once: its stored residuals and weight residuals while a pass runs, plus
    what that pass holds.

    ``synced`` (``EventLoop(synced=...)``): a pass takes its virtual time when called, so the loop's view of
    an idle device must not depend on real kernels. Stages that return numpy arrays are finished when they
    return, and the loop may dispatch asynchronously (as in training); stages that run real JAX kernels need
    ``synced=True``, else whether the CPU finished one would decide the order."""
    clock = VirtualClock(costs)
    n = costs.num_stages
    results, orders, peaks, errors = [None] * n, [None] * n, [0] * n, []

    def rank(r: int) -> None:
        try:
            loop = None

            def probe(k: int) -> None:
                peaks[r] = max(peaks[r], len(loop.residuals) + len(loop.wres) + k)

            stage = ClockedStage(clock, r, stages[r], probe)
            loop = EventLoop({r: stage}, tuple(range(n)), r, ClockedTransport(clock, r),
                             loop_policy(schedule, weight_budget), join=clocked_join(join), synced=synced)
            results[r] = loop.run(schedule, {r: params[r]}, tokens, cotangent)
            orders[r] = loop.order
        except BaseException as e:  # re-raised below, after every rank has stopped
            errors.append(e)
        finally:
            clock.finish(r)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, orders, peaks
