"""When the event loop waits for its kernels (Myelin Sec. IV-A asynchrony), and what it has in flight.

Unsynced (``pipeline.dispatch`` async, or auto off the CPU: :func:`synced_dispatch` says why not on it), a
task's kernel is only dispatched; JAX queues it behind the kernels before it and the loop goes on to the
next task (:mod:`~jaxhybrid.parallel.pipeline.event_loop`), so the device does not idle while the host
dispatches (a synchronous jit call leaves a GPU idle for its whole host-side cost). The loop waits only
where it must: a send needs its payload on the host (:mod:`~jaxhybrid.parallel.pipeline.mpi_transport`), and
message-driven 2BP fills only idle device time with a weight pass, one at a time
(:mod:`~jaxhybrid.parallel.pipeline.message_driven`). Receives stay safe: over mpi4jax one starts only once
its sender is in ``MPI_Send``; the mpi4py transport's are posted ahead. ``run`` returns only once every
message of the step is received and sent (``flush``), so the collectives after the phase (tied sum,
all-reduce) wait on kernels that need nothing from a peer. The ``progress`` heartbeat marks dispatches:
a step's last beat can precede kernels still queued, within the watchdog's deadline.

With ``synced`` every task waits for its kernel, so the recorder holds kernel times: the step whose trace
is written (``PipelineEngine.time_tasks``) and ``jaxhybrid bench pipeline`` run so. Unsynced steps record
dispatch spans (kind ``"dispatch"``) that no trace or bubble ratio counts as compute;
:attr:`EventLoop.order` is the order of the tasks run, in either mode. :class:`InFlight` tells, without
blocking (``jax.Array.is_ready``), whether the device has drained its queue, which the message-driven
gap fill needs.
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
    wakes on that core every 0.2 ms at most, so an asynchronous step runs slower than a synced one (a
    longer polling back-off would win that back at the cost of message latency where the host does not
    share the device's cores). On a GPU the polling costs the device nothing.
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
