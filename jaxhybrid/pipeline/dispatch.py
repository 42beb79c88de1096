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
