"""The pipeline event loop: executes a :class:`~jaxhybrid.parallel.pipeline.tasks.Schedule` on one rank.

The loop holds one of two policies, chosen when it is built (:func:`loop_policy`). Schedules are data; a
policy decides only the order of work, and only the message-driven one decides anything:

- :class:`FixedOrder` (schedules of policy ``static``): run this rank's row of tasks in order. A task
  whose input is a message (an activation for ``F``, a gradient for ``B``/``BI``) waits for it; messages
  that arrive early wait in a mailbox, so any valid schedule runs whatever the arrival order.
- :class:`~jaxhybrid.parallel.pipeline.message_driven.MessageDriven` (Myelin Alg. 2): each arriving message
  picks the work; with 2BP the weight passes fill the time no message is waiting.

A policy drives the loop through its task methods (:meth:`EventLoop.forward`, :meth:`EventLoop.backward`,
:meth:`EventLoop.weight_pass`, :meth:`EventLoop.execute`), its mailbox and :meth:`EventLoop.receive`.

Dispatch (Myelin Sec. IV-A): unsynced, a task's kernel is only dispatched and the loop goes on; with
``synced`` every task waits for its kernel and the recorder holds kernel times (traces, benchmarks). When
it may wait, and why that is safe: :mod:`~jaxhybrid.parallel.pipeline.dispatch`.

The loss is pre-divided by the number of microbatches in the global batch (Myelin Sec. IV-B): the last
stage's output cotangent is ``loss_scale / (microbatches x replicas)``, so summing the stage gradients
over microbatches and replicas gives the gradient of ``mean loss x loss_scale``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.parallel.pipeline.dispatch import InFlight
from jaxhybrid.parallel.pipeline.message_driven import MessageDriven
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule, Task
from jaxhybrid.parallel.pipeline.trace import Recorder
from jaxhybrid.parallel.pipeline.transport import Envelope, MsgKind, Transport, wait_message


class Policy(Protocol):
    """What decides the order of a rank's work in one step; ``name`` is the schedules' ``policy`` it runs."""

    name: str

    def run(self, loop: EventLoop, schedule: Schedule) -> None: ...


class FixedOrder:
    """The static policy: this rank's row of the schedule, task by task (a task waits for its message)."""

    name = "static"

    def run(self, loop: EventLoop, schedule: Schedule) -> None:
        for t in schedule.rows[loop.rank]:
            loop.execute(t, schedule.split_backward)


def loop_policy(schedule: Schedule, weight_budget: int = 0) -> Policy:
    """The policy that runs ``schedule``: Myelin Alg. 2 for a message-driven schedule (``weight_budget``:
    its 2BP bound, 0 = the number of stages), else the fixed order of its rows."""
    return MessageDriven(weight_budget) if schedule.policy == MessageDriven.name else FixedOrder()


@dataclass
class StepResult:
    loss_sum: jax.Array | None  # sum of microbatch mean losses (last stage only)
    grads: dict[int, Any]  # stage -> summed gradients of loss * cotangent
    wall_s: float  # first task to the end of the flush (unsynced: kernels may still be running then)


class EventLoop:
    """Runs one training step's pipeline phase for the stages owned by ``rank``, in the order its policy
    decides.

    Args:
      stages: ``{stage index: Stage}`` for the stages this rank runs (jaxhybrid.parallel.twobp.stage.Stage API).
      stage_to_rank: row rank of every logical stage.
      rank: this process's rank in the pipeline row.
      transport: a :class:`~jaxhybrid.parallel.pipeline.transport.Transport`.
      policy: what orders the work (:func:`loop_policy` of the schedules it will run); it runs only
        schedules of its kind. The engine swaps it with the schedule (``PipelineEngine.set_schedule``).
      join: ``join(stage, parts)`` hands the weight residuals of several microbatches to one ``BW`` call
        (:func:`jaxhybrid.parallel.twobp.stage.weight_join`): the list (the default; the stage sums their weight
        passes in one program) or one batch (one larger matmul per site, 2BP Fig. 2).
      progress: called after every task and message (the watchdog's heartbeat).
      waiting: called with what the loop is about to wait for (named in the watchdog's report).
      synced: wait for every task's kernel and record its time (traces, benchmarks); False (training):
        dispatch asynchronously and record dispatch spans (module docstring). May be changed between steps.
    """

    def __init__(self, stages: dict[int, Any], stage_to_rank: tuple[int, ...], rank: int, transport: Transport,
                 policy: Policy | None = None,
                 join: Callable[[Any, list[Any]], Any] = lambda stage, parts: list(parts),
                 progress: Callable[[str], None] | None = None,
                 waiting: Callable[[str], None] | None = None,
                 peer_name: Callable[[int], str] | None = None, synced: bool = False):
        self.stages, self.stage_to_rank, self.rank = stages, tuple(stage_to_rank), rank
        self.num_stages = len(self.stage_to_rank)
        self.transport, self.join = transport, join
        self.policy = policy or FixedOrder()
        self.progress = progress or (lambda what: None)
        self.waiting = waiting or (lambda what: None)
        # How waits, receives and the journal name a peer (by its rank in the pipeline row); the MPI runner
        # says its world rank, stage and replica, as every other message names a rank.
        self.peer_name = peer_name or (lambda r: f"pipeline rank {r}")
        self.synced = synced
        self.recorder = Recorder(rank)
        self.order: list[Task] = []  # the last step's tasks in the order this rank dispatched them
        self.inflight = InFlight()
        self._zeros: dict[int, Callable[[Any], Any]] = {}  # stage -> jitted zeros shaped like its params
        # Called with (stage, gradient sum) once a stage's gradients are final (every microbatch's backward or weight
        # pass has written them): the data-parallel reduction starts there. Set per step by the engine.
        self.on_final: Callable[[int, Any], None] | None = None

    # -- one step ------------------------------------------------------------------------------------
    def run(self, schedule: Schedule, params: dict[int, Any], tokens: jax.Array, cotangent: float) -> StepResult:
        """``tokens``: ``int32 [M, mb, seq+1]`` (every rank gets them; only the ends read them)."""
        if tuple(schedule.stage_to_rank) != self.stage_to_rank:
            raise ValueError(f"schedule {schedule.name!r} maps stages to ranks {schedule.stage_to_rank}, "
                             f"the engine was built for {self.stage_to_rank}")
        if schedule.num_microbatches != tokens.shape[0]:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.num_microbatches} microbatches, "
                             f"the batch has {tokens.shape[0]}")
        if schedule.policy != self.policy.name:
            raise ValueError(f"schedule {schedule.name!r} is {schedule.policy}; this loop was built with the "
                             f"{self.policy.name} policy (EventLoop(policy=loop_policy(schedule)))")
        # Host tokens: slicing numpy is free, slicing a device array is an eager op per microbatch.
        self.params, self.tokens = params, np.asarray(tokens)
        self.cot = jnp.float32(cotangent)
        self.mailbox: dict[Envelope, Any] = {}
        self.residuals: dict[tuple[int, int], Any] = {}
        self.wres: dict[tuple[int, int], Any] = {}
        self.grads: dict[int, Any] = {}
        self.losses: list[jax.Array] = []
        self.recorder = Recorder(self.rank, synced=self.synced)
        self.order, self.inflight = [], InFlight()
        self._written: dict[int, int] = {}  # stage -> microbatches in its gradient sum
        self._microbatches = schedule.num_microbatches
        start = time.perf_counter()
        self.policy.run(self, schedule)
        t0 = time.perf_counter()
        self.transport.flush()
        self.recorder.add("flush", "wait", t0, time.perf_counter())
        if self.residuals or self.wres or self.mailbox:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule {schedule.name!r} left work undone: residuals "
                               f"{sorted(self.residuals)}, weight residuals {sorted(self.wres)}, unread "
                               f"messages {[str(e) for e in self.mailbox]}")
        loss = None
        if self.losses:
            loss = self.losses[0]
            for x in self.losses[1:]:
                loss = loss + x
        self.wall_s = time.perf_counter() - start
        # The step's arrays leave with the result: kept here, the unreduced gradients stayed on the device
        # through the all-reduce, the update and any save, beside the reduced ones (a stage's gradients twice).
        grads, self.grads, self.params, self.losses = self.grads, {}, None, []
        self.inflight = InFlight()  # its leaves (activations sent, input gradients) are the step's too
        return StepResult(loss, grads, self.wall_s)

    def evaluate(self, params: dict[int, Any], tokens: jax.Array) -> jax.Array | None:
        """Forward only over every microbatch (validation): each owned stage runs ``Stage.evaluate``
        (no residuals) in (microbatch, stage) order and sends its activation on. Every rank walks that
        one global order, so with asynchronous sends no rank waits on one that waits on it. Returns the
        sum of the microbatch losses where the last stage lives, else None. The step's trace is kept."""
        self.tokens, self.mailbox = np.asarray(tokens), {}
        kept, self.recorder = self.recorder, Recorder(self.rank)
        total = None
        try:
            for mb in range(self.tokens.shape[0]):
                for s in sorted(self.stages):
                    x, targets = self._inputs(s, mb)
                    y = self.stages[s].evaluate(params[s], x, targets)
                    self.progress(f"evaluated mb{mb}@s{s}")
                    if s < self.num_stages - 1:
                        self._send(y, MsgKind.ACT, mb, s + 1)
                    else:
                        total = y if total is None else total + y
            self.transport.flush()
        finally:
            self.recorder = kept
        return total

    # -- messages ------------------------------------------------------------------------------------
    def receive(self, block: bool) -> bool:
        """Move one message into the mailbox (waiting for it if ``block``); False if none had arrived."""
        t0 = time.perf_counter()
        msg = wait_message(self.transport) if block else self.transport.poll()
        if msg is None:
            return False
        env = msg.envelope
        self.recorder.add(f"recv {env}", "wait" if block else "recv", t0, time.perf_counter(),
                          (env.microbatch,), env.stage)
        self.mailbox[msg.envelope] = msg.payload
        self.progress(f"received {msg.envelope} from {self.peer_name(msg.source)}")
        return True

    def report(self) -> str:
        """The transport's last sends and receives with each peer named as the waits name it (the
        watchdog's report)."""
        return self.transport.journal.report(self.peer_name)

    def _take(self, env: Envelope) -> Any:
        if env not in self.mailbox:
            src = self.stage_to_rank[env.stage - 1 if env.kind is MsgKind.ACT else env.stage + 1]
            self.waiting(f"waiting for {env} from {self.peer_name(src)}")
        while env not in self.mailbox:
            self.receive(block=True)
        return self.mailbox.pop(env)

    def _send(self, x: Any, kind: MsgKind, mb: int, stage: int) -> None:
        t0 = time.perf_counter()
        env = Envelope(kind, mb, stage)
        if self.stage_to_rank[stage] == self.rank:  # a stage of this rank's own (virtual stages): no transport
            self.mailbox[env] = x
            self.progress(f"delivered {env} to this rank")
        else:
            self.transport.send(x, self.stage_to_rank[stage], env)
        self.recorder.add(f"send {kind.name} mb{mb}->s{stage}", "send", t0, time.perf_counter(), (mb,), stage)

    # -- tasks ---------------------------------------------------------------------------------------
    def _timed(self, kind: str, mbs: tuple[int, ...], s: int, fn: Callable[[], Any]) -> Any:
        name = kind + "+".join(map(str, mbs)) + f"@s{s}"
        t0 = time.perf_counter()
        out = fn()
        if self.synced:
            out = jax.block_until_ready(out)  # measured compute, not dispatch (the trace shows real kernels)
            self.recorder.add(name, kind, t0, time.perf_counter(), mbs, s)
        else:  # queued behind the kernels before it: the span is the dispatch, never a kernel time
            self.inflight.add(out)
            self.recorder.add(name, "dispatch", t0, time.perf_counter(), mbs, s)
        self.order.append(Task(Kind(kind), tuple(mbs), s))
        self.progress(f"{'ran' if self.synced else 'dispatched'} {name}")
        return out

    def execute(self, t: Task, split: bool) -> None:
        """Run one task of a schedule's row (its input message taken from the mailbox, waited for)."""
        s, mb = t.stage, t.microbatch
        if t.kind is Kind.F:
            self.forward(s, mb)
        elif t.kind in (Kind.B, Kind.BI):
            self.backward(s, mb, split=t.kind is Kind.BI)
        elif t.kind is Kind.BW:
            self.weight_pass(s, t.microbatches)
        else:
            raise ValueError(f"pipeline rank {self.rank}: unknown task {t}")

    def _inputs(self, s: int, mb: int) -> tuple[Any, Any]:
        """Stage ``s``'s input for microbatch ``mb`` (tokens, or the previous stage's activation) and
        its targets (last stage only)."""
        x = self.tokens[mb, :, :-1] if s == 0 else self._take(Envelope(MsgKind.ACT, mb, s))
        return x, self.tokens[mb, :, 1:] if s == self.num_stages - 1 else None

    def forward(self, s: int, mb: int) -> None:
        """Stage ``s``'s forward of microbatch ``mb``; its activation goes on (the last stage keeps the loss)."""
        stage = self.stages[s]
        last = s == self.num_stages - 1
        x, targets = self._inputs(s, mb)
        y, res = self._timed("F", (mb,), s, lambda: stage.forward(self.params[s], x, targets))
        self.residuals[(s, mb)] = res
        if last:
            self.losses.append(y)
        else:
            self._send(y, MsgKind.ACT, mb, s + 1)

    def backward(self, s: int, mb: int, split: bool) -> None:
        """Stage ``s``'s backward of ``mb``: with ``split`` 2BP's backward-p1 only (its weight residuals
        kept for :meth:`weight_pass`), else the fused backward; the input gradient goes back."""
        stage = self.stages[s]
        dy = self.cot if s == self.num_stages - 1 else self._take(Envelope(MsgKind.GRAD, mb, s))
        res = self.residuals.pop((s, mb))
        if split:
            dx, wres = self._timed("BI", (mb,), s, lambda: stage.backward_input(res, dy))
            self.wres[(s, mb)] = wres
        else:
            acc = self._grad_sum(s)
            dx, self.grads[s] = self._timed("B", (mb,), s, lambda: stage.backward(res, dy, acc))
            self._wrote(s, 1)
        if s > 0:
            self._send(dx, MsgKind.GRAD, mb, s - 1)

    def weight_pass(self, s: int, mbs: tuple[int, ...]) -> None:
        """2BP backward-p2 of stage ``s`` over microbatches ``mbs`` in one call (Fig. 2)."""
        stage = self.stages[s]
        parts = [self.wres.pop((s, m)) for m in mbs]
        acc = self._grad_sum(s)

        def weight_pass():  # one BW over several microbatches (2BP Fig. 2), joined as ``join`` says
            wres = self.join(stage, parts) if len(parts) > 1 else parts[0]
            return stage.backward_weight(self.params[s], wres, acc)

        self.grads[s] = self._timed("BW", tuple(mbs), s, weight_pass)
        self._wrote(s, len(mbs))

    def _wrote(self, s: int, n: int) -> None:
        """``n`` more microbatches in stage ``s``'s gradient sum; at all of them it is final (:attr:`on_final`)."""
        self._written[s] = self._written.get(s, 0) + n
        if self._written[s] == self._microbatches and self.on_final is not None:
            self.on_final(s, self.grads[s])

    def _grad_sum(self, s: int) -> Any:
        """Stage ``s``'s gradient sum so far (zeros before its first backward), for the next kernel to add
        its gradients to and to donate: one program per microbatch instead of a kernel and an add."""
        acc = self.grads.pop(s, None)
        if acc is not None:
            return acc
        if s not in self._zeros:
            # One program with the params' shardings (a tensor rank's leaves are sharded), not an eager
            # zeros_like per leaf: a dispatch per leaf, more than the adds it replaces save.
            shardings = jax.tree.map(lambda a: a.sharding, self.params[s])
            self._zeros[s] = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=shardings)
        return self._zeros[s](self.params[s])
