"""What the event loop has dispatched and the device has not finished (Myelin Sec. IV-A asynchrony).

In normal training the loop (:mod:`~jaxhybrid.pipeline.engine`) does not wait for its kernels: JAX's
dispatch is asynchronous, so the next task's program is queued while the device still runs the last one,
and the device does not idle for the host's dispatch (about 1.1 ms per task by the H100's jit call costs,
README "Known limits", when the loop waited for every task). The loop still needs to know one thing about
the device: whether it has drained its queue, because Myelin's message-driven 2BP fills only *idle* time
with a weight pass (:mod:`~jaxhybrid.pipeline.message_driven`). :class:`InFlight` answers that without
blocking, from ``jax.Array.is_ready``.
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
    """The kernels dispatched and not yet finished, one output leaf each (pruned as they finish)."""

    def __init__(self) -> None:
        self._pending: list[Any] = []

    def add(self, out: Any) -> None:
        leaf = _future(out)
        if leaf is not None:
            self._pending.append(leaf)

    def count(self) -> int:
        """How many dispatched kernels have not finished yet."""
        self._pending = [x for x in self._pending if not _finished(x)]
        return len(self._pending)

    def drained(self) -> bool:
        """True when the device has run everything dispatched so far (never blocks)."""
        return self.count() == 0
