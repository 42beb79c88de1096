"""Stopping a training run on SIGINT / SIGTERM at a step boundary, with its last step saved.

Why at a boundary: a step donates the parameter and optimizer buffers to its update, so the state from
before an interrupted step can no longer be read, let alone saved. The first signal only sets a flag the
loop reads after each step; a second one interrupts at once (a step that hangs). SIGTERM is what Slurm's
time limit, ``scancel`` and mpiexec's own shutdown send before SIGKILL, so a preempted job keeps its work.
"""
from __future__ import annotations

import signal
import threading


class StopOnSignal:
    """Context manager: while active, SIGINT and SIGTERM set :attr:`requested` (the signal's name); the
    previous handlers come back on exit. Outside the main thread (where Python allows no handlers) it
    does nothing, and signals act as they did."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.requested is not None:  # the second signal: do not wait for the step any longer
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
