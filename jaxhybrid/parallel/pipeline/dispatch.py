"""When the event loop waits for its kernels (Myelin Sec. IV-A asynchrony), and what it has in flight.

Unsynced (``pipeline.dispatch`` async, or auto off the CPU: :func:`synced_dispatch` says why not on it), a
task's kernel is only dispatched; JAX queues it behind the kernels before it and the loop goes on to the
next task (:mod:`~jaxhybrid.parallel.pipeline.event_loop`), so the device does not idle while the host dispatches (on an H100 a jit call took 0.5 ms to dispatch and
0.6 ms to return synchronously, README "Known limits": 0.6-1.1 ms of idle device per task for a loop
that waited for each). The loop waits only where it must: a send needs its payload on the host (the
transports wait for it, :mod:`~jaxhybrid.parallel.pipeline.mpi_transport`), and message-driven 2BP fills only idle
device time with a weight pass, one at a time (:mod:`~jaxhybrid.parallel.pipeline.message_driven`). Receives stay
safe: over mpi4jax one still starts only once its sender, its payload computed, is in ``MPI_Send`` (the
mpi4py transport's are posted ahead and complete whenever their ``Isend`` arrives); the collectives
after the phase (tied sum, all-reduce) wait for queued kernels, but ``run`` returns only once every
message of the step is received and sent (``flush``), so those kernels need nothing from a peer. The
``progress`` heartbeat marks dispatches: a step's last beat can precede the kernels still queued (on a
one-stage rank, the whole step's) within the watchdog's deadline. With ``synced`` every task waits for its
kernel instead, so the recorder holds kernel times: the step whose trace is written
(``PipelineEngine.time_tasks``) and ``jaxhybrid bench pipeline`` run so. Unsynced steps record dispatch
spans (kind ``"dispatch"``) that no trace or bubble ratio counts as compute; :attr:`EventLoop.order` is
the order of the tasks run, in either mode.

The loop still needs to know one thing about the device: whether it has drained its queue, because
Myelin's message-driven 2BP fills only *idle* time with a weight pass
(:mod:`~jaxhybrid.parallel.pipeline.message_driven`). :class:`InFlight` answers that without blocking, from
``jax.Array.is_ready``.
"""
from __future__ import annotations

from typing import Any

import jax


def _future(tree: Any) -> Any:
    """One output leaf that can say whether its program has finished (all outputs of one program become
    ready together), or None when none can (numpy results of test stages: already computed)."""
    return next((x for x in jax.tree.leaves(tree) if hasattr(x, "is_ready")), None)


def _finished(x: Any) -> bool:
    # A donated output (a gradient sum handed to the next kernel) is deleted, and asking a deleted array
    # is_ready() raises: its consumer was dispatched after it and is tracked, so it counts as done here.
    return x.is_deleted() or x.is_ready()


def synced_dispatch(setting: str, platform: str) -> bool:
    """Whether the event loop waits for every kernel (``pipeline.dispatch``: async, sync, or auto).

    auto waits on CPU. There the device is the rank's own core: a kernel queued behind the running one
    gains nothing (no second processor to run it), and while kernels run, the loop's polling for messages
    wakes on that core every 0.2 ms at most. Measured on this 2-core machine (session 31, ``jaxhybrid bench
    pipeline``, 2 ranks pinned, Myelin's schedule, M = 4): the asynchronous step took 1.04-1.13x the synced
    one, and 0.98-1.01x with the polling back-off raised to 2 ms (which would cost message latency where the
    host does not share the device's cores). On a GPU the polling costs the device nothing.
    """
    if setting not in ("auto", "async", "sync"):
        raise ValueError(f"pipeline.dispatch={setting!r}; choose auto, async or sync")
    return setting == "sync" or (setting == "auto" and platform == "cpu")


class InFlight:
    """The kernels dispatched and not yet finished, one output leaf each. A held leaf keeps its buffer
    alive, so finished ones are dropped at every ``add`` and ``count``: what stays is what the device still
    computes (an activation already sent is not held through the step, nor the step's through the update)."""

    def __init__(self) -> None:
        self._pending: list[Any] = []

    def add(self, out: Any) -> None:
        leaf = _future(out)
        self._pending = [x for x in self._pending if not _finished(x)]
        if leaf is not None:
            self._pending.append(leaf)

    def count(self) -> int:
        """How many dispatched kernels have not finished yet."""
        self._pending = [x for x in self._pending if not _finished(x)]
        return len(self._pending)

    def drained(self) -> bool:
        """True when the device has run everything dispatched so far (never blocks)."""
        return self.count() == 0
