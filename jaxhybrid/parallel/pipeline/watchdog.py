"""Fault handling for MPI jobs: a failing or stuck rank ends the whole job fast, naming itself.

- :func:`install_abort_on_exception`: an uncaught exception on any thread of any rank prints
  ``jaxhybrid: rank R (stage i, replica j) failed: ...`` and calls ``MPI_Abort`` (mpich does not end a
  job when one rank raises: the others hang in their receives).
- :class:`Watchdog`: a daemon thread; while armed, if the rank reports no progress for ``deadline_s``
  seconds it prints what the rank was doing and its last sends and receives, then aborts the job.
  A killed rank is detected by the launcher (hydra ends the job and names the rank).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

from jaxhybrid.core.errors import is_disk_full

# Seconds between writing a failure's report and MPI_Abort. Why: the abort makes mpiexec's proxies kill
# every process and stop, and a report still in the pipe to this rank's proxy could be lost (the job
# ended, but no line named the failing process).
ABORT_GRACE_S = 0.25


def _abort(comm: Any, code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    if comm is not None:
        time.sleep(ABORT_GRACE_S)  # let the launcher read the report first
        comm.Abort(code)
    os._exit(code)


_REPORT: list[Callable[[type, BaseException, Any], None]] = []  # this rank's report, once it joined a job


def install_abort_on_exception(who: str, comm: Any = None) -> None:
    """Make any uncaught exception (main or other threads) abort the whole MPI job, naming ``who``."""

    def report(exc_type, exc, tb) -> None:
        # A full disk is no bug to trace: its line names the folder and the bytes, and the peers' failing
        # writes would repeat it.
        text = "" if is_disk_full(exc) else "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"{text}jaxhybrid: {who} failed: {exc_type.__name__}: {exc}; aborting the job\n")
        _abort(comm, 1)

    sys.excepthook = report
    threading.excepthook = lambda args: report(args.exc_type, args.exc_value, args.exc_traceback)
    _REPORT[:] = [report]


def report_if_in_job(exc: BaseException) -> None:
    """On a rank that joined an MPI job (:func:`install_abort_on_exception`), report ``exc`` as a failure
    of that rank (its traceback, the line naming the rank) and abort the job; elsewhere return. The
    command line turns ValueError and FileNotFoundError into one-line setup errors, which on a rank
    in mid-training hid both the rank and where it failed."""
    if _REPORT:
        _REPORT[0](type(exc), exc, exc.__traceback__)


class Watchdog:
    """Aborts the job when an armed rank stops making progress.

    Args:
      who: how this rank is named in messages (e.g. ``"rank 3 (stage 1, replica 1)"``).
      deadline_s: seconds without progress before aborting (``pipeline.watchdog_s``).
      compile_deadline_s: the deadline the first time each phase is armed (``pipeline.watchdog_compile_s``;
        default ``deadline_s``): the rank compiles its kernels then, and its peers wait for every stage's
        compiles in turn (the last stage for the forwards before it, the first for every other stage's
        forward and backward), which on a large model can take longer than a hang should.
      report: returns extra text (the last sends and receives) for the message.
      comm: communicator to abort (``MPI.COMM_WORLD``); None exits this process only (tests).
      on_fire: replaces the abort (tests of the in-process engine).
    """

    def __init__(self, who: str, deadline_s: float, report: Callable[[], str] = lambda: "",
                 comm: Any = None, on_fire: Callable[[str], None] | None = None, compile_deadline_s: float = 0.0):
        if deadline_s <= 0:
            raise ValueError(f"pipeline.watchdog_s={deadline_s} must be > 0")
        self.who, self.deadline_s, self.report, self.comm = who, deadline_s, report, comm
        self.compile_deadline_s = compile_deadline_s
        self._deadline = deadline_s
        self._seen: set[str] = set()  # phases armed before: compiled
        self.on_fire = on_fire
        self._last = time.monotonic()
        self._doing = "idle"
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxhybrid-watchdog", daemon=True)
        self._thread.start()

    def beat(self, doing: str) -> None:
        """Record progress (called by the event loop after every task and message)."""
        self._last = time.monotonic()
        self._doing = doing

    def note(self, doing: str) -> None:
        """Say what the rank is doing now without counting it as progress (e.g. waiting for a message)."""
        self._doing = doing

    def arm(self, doing: str = "pipeline step") -> None:
        first = doing not in self._seen
        self._seen.add(doing)
        self._deadline = max(self.deadline_s, self.compile_deadline_s) if first else self.deadline_s
        self.beat(doing)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    @contextlib.contextmanager
    def watching(self, doing: str):
        """Armed for the body (a collective every rank must reach: a peer that froze outside the
        pipeline phase leaves this rank waiting in it), and back to the earlier state after: inside an
        armed region it only names what the rank waits for, without counting that as progress."""
        was, before = self._armed, self._doing
        if was:
            self.note(doing)
        else:
            self.arm(doing)
        try:
            yield
        finally:
            if was:
                self._doing = before
            else:
                self.disarm()

    def close(self) -> None:
        self._stop.set()

    def message(self) -> str:
        idle = time.monotonic() - self._last
        first = " (the first time: compiling)" if self._deadline != self.deadline_s else ""
        return (f"jaxhybrid watchdog: {self.who} made no progress for {idle:.1f} s (deadline "
                f"{self._deadline:g} s{first}); now: {self._doing}; {self.report()}")

    def _watch(self) -> None:
        step = min(0.1, self.deadline_s / 4)
        while not self._stop.wait(step):
            if self._armed and time.monotonic() - self._last > self._deadline:
                msg = self.message()
                if self.on_fire is not None:
                    self._armed = False
                    self.on_fire(msg)
                    continue
                sys.stderr.write(msg + "; aborting the job\n")
                _abort(self.comm, 3)
