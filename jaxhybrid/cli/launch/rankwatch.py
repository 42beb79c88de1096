"""Which rank of a failed ``jaxhybrid launch`` job to name, for the launcher's report.

Each rank records ``rank -> pid`` in the directory given by ``JAXHYBRID_PID_DIR`` when its topology is
made, holds the write end of its ``rank<r>.alive`` FIFO there until it ends, and leaves a ``rank<r>.exit``
marker when its interpreter exits normally (see :mod:`jaxhybrid.parallel.pipeline.topology`). A rank killed by a signal
(the OOM killer, ``kill -9``) leaves no Python message, and hydra's report is no help: it names the PID of
whichever process it saw end, often a bystander that MPI aborted once its peer vanished.
:class:`RankWatch` watches the ranks while the job runs and keeps the order in which they ended, so the
launcher can name the first rank that ended without its exit marker and without mpich's report that it
aborted on a peer's failure (:func:`bystanders`); all of them when several end before the watcher wakes.
A rank that reported its own failure is named before any of that (:func:`failure_summary`).
"""
from __future__ import annotations

import os
import re
import select
import threading
from pathlib import Path

PID_DIR_ENV = "JAXHYBRID_PID_DIR"


def read_pid_files(pid_dir: Path) -> dict[int, str]:
    """``pid -> "rank r (stage i, replica j)"`` from the files the ranks wrote so far."""
    out = {}
    for f in Path(pid_dir).glob("rank*.pid"):
        pid, _, who = f.read_text().partition(" ")
        if pid.strip().isdigit():
            out[int(pid)] = who.strip()
    return out


def exited_normally(pid_dir: Path, who: str) -> bool:
    """Whether the rank named ``who`` left its normal-exit marker."""
    return (Path(pid_dir) / f"rank{_rank_of(who)}.exit").exists()


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None: no pidfd support, or already gone (then
    :func:`_alive` notices)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _alive(pid: int) -> bool:
    """A zombie (ended, not yet reaped by hydra's proxy) counts as ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone, or no /proc: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir() or Path(f"/proc/{pid}").exists()


def alive_fifo(pid_dir: Path | str, rank: int) -> Path:
    """The FIFO whose write end rank ``rank`` holds open for its lifetime (:meth:`RankWatch.__init__`)."""
    return Path(pid_dir) / f"rank{rank}.alive"


class RankWatch(threading.Thread):
    """Records the order in which the ``n`` ranks end: ``ended`` is a list of ``(wake-up number, pid, who)``.

    A rank has ended at the first of two events, whichever the thread's ``poll`` sees first:
    - its FIFO hung up (:func:`alive_fifo`, made here before the job starts; the rank opens the write end
      when its topology is made). The kernel closes a dying process's files, its pipes to hydra's proxy
      among them, before it reports the exit that a pidfd waits for; a thread still freeing the address
      space can delay that report past the end of a bystander that hydra killed meanwhile, so pidfds
      alone sometimes name the wrong rank;
    - its PID ended: a pidfd (Linux 5.3) or, without one, a ``period_s`` polling loop. This catches a
      rank that ended before it opened its FIFO.
    PID files are read until all ``n`` ranks appeared. Hydra needs milliseconds to stop the others, so
    the first rank usually ends alone in its wake-up."""

    def __init__(self, pid_dir: Path, n: int, period_s: float = 0.02):
        super().__init__(daemon=True, name="jaxhybrid-rankwatch")
        self.pid_dir, self.n, self.period_s = Path(pid_dir), n, period_s
        self.ended: list[tuple[int, int, str]] = []
        self._halt = threading.Event()
        self._fifos: dict[int, int] = {}  # fd of the read end -> rank
        for r in range(n):
            path = alive_fifo(self.pid_dir, r)
            try:
                if not path.exists():
                    os.mkfifo(path)
                # Non-blocking: opening does not wait for a writer, and poll reports a hang-up only after
                # one has connected and gone.
                self._fifos[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = r
            except OSError:  # a filesystem without FIFOs ($TMPDIR on some FUSE mounts): the PIDs still tell
                pass

    def run(self) -> None:
        names: dict[int, str] = {}  # pid -> who, every rank seen so far
        pidfds: dict[int, int | None] = {}  # pid -> its pidfd (None: polled)
        poller, tick = select.poll(), 0
        for fd in self._fifos:
            poller.register(fd, select.POLLIN)

        def drop(fd: int | None) -> None:
            if fd is not None:
                poller.unregister(fd)
                os.close(fd)
                self._fifos.pop(fd, None)

        def learn() -> None:
            for pid, who in read_pid_files(self.pid_dir).items():
                if pid not in names:
                    names[pid], pidfds[pid] = who, _pidfd(pid)
                    if pidfds[pid] is not None:
                        poller.register(pidfds[pid], select.POLLIN)

        try:
            while not self._halt.is_set():
                if len(names) < self.n:
                    learn()
                ready = {fd for fd, _ in poller.poll(self.period_s * 1000)}
                tick += 1
                hung = {self._fifos[fd] for fd in ready if fd in self._fifos}
                if len(names) < self.n and hung:
                    learn()  # a rank writes its PID file before it opens its FIFO
                gone = sorted(p for p, fd in pidfds.items()
                              if (fd in ready if fd is not None else not _alive(p)) or _rank_of(names[p]) in hung)
                for pid in gone:
                    rank = _rank_of(names[pid])
                    drop(pidfds.pop(pid))
                    drop(next((fd for fd, r in self._fifos.items() if r == rank), None))
                    self.ended.append((tick, pid, names[pid]))
                for fd in ready & set(self._fifos):  # hung up with no PID file: its PID is watched instead
                    drop(fd)
        finally:
            for fd in [*pidfds.values(), *self._fifos]:
                if fd is not None:
                    os.close(fd)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def first_abnormal(self, bystanders: set[int] = frozenset()) -> list[str]:
        """``"rank r (...) (pid n)"`` of the first rank seen to end without its exit marker, or of all
        those seen to end in the same wake-up (their order is unknown: hydra's report is no tie-break, it
        named bystanders). ``bystanders`` (:func:`bystanders`) are passed over while another rank ended
        abnormally: a rank that MPI aborted because its peer vanished can finish exiting before the
        killed peer does (seen once in 30 runs). Empty if no rank was seen to end abnormally."""
        abnormal = [(tick, pid, who) for tick, pid, who in self.ended if not exited_normally(self.pid_dir, who)]
        culprits = [e for e in abnormal if _rank_of(e[2]) not in bystanders] or abnormal
        return [f"{who} (pid {pid})" for tick, pid, who in culprits if tick == culprits[0][0]]


# A rank's own report of its failure (jaxhybrid.parallel.pipeline.watchdog): "jaxhybrid: rank R (stage i, replica j)
# failed: ..." ("stages i+k" for a rank of several virtual stages) or "jaxhybrid watchdog: rank R (...) made no progress ..."; a --distributed process's:
# "jaxhybrid: process R of N (--distributed) failed: ..." (jaxhybrid.runtime.distributed.abort_on_exception).
_OWN_REPORT = re.compile(r"jaxhybrid(?: watchdog)?: ((?:rank|process) (\d+) (?:\(stages? [\d+]+, replica \d+\)|of \d+ "
                         r"\(--distributed\))) .*?(failed|made no progress)")

# A watchdog report of a rank stuck waiting on a peer: "... made no progress ...; now: waiting for <message>
# from rank R (stage i, replica j); ..." (the event loop's wait, jaxhybrid.parallel.pipeline.event_loop).
_WAITED_FOR = re.compile(r"jaxhybrid watchdog: .*? made no progress .*?; now: waiting for .*? from "
                         r"(rank \d+ \(stages? [\d+]+, replica \d+\))")


# How a line of jaxhybrid's own starts ("jaxhybrid: ", "jaxhybrid train: "), and an error a user can fix
# as `jaxhybrid COMMAND` prints it (jaxhybrid.cli.main) before the process exits.
REPORT_PREFIX = r"jaxhybrid(?: [\w-]+)?: "
_SETUP_ERROR = re.compile(REPORT_PREFIX + "error: ")
TIMED_OUT = "APPLICATION TIMED OUT"  # hydra's line when MPIEXEC_TIMEOUT (jaxhybrid launch --timeout) ran out


def evidence(line: str) -> bool:
    """Whether :func:`failure_summary` reads ``line`` of the job's output (the launcher keeps only these):
    hydra's ``RUNNING AT`` and timeout lines, mpich's ``Abort(``, the ranks' own ``jaxhybrid`` reports."""
    return "RUNNING AT" in line or "Abort(" in line or TIMED_OUT in line or line.startswith("jaxhybrid")


def _own_reports(output_lines: list[str]) -> list[tuple[int, str, str, str]]:
    """``(rank, who, "failed" or "made no progress", line)`` of each rank's own failure report, in the order
    of the reports."""
    return [(int(m.group(2)), m.group(1), m.group(3), line) for line in output_lines
            for m in [_OWN_REPORT.search(line)] if m]


def reporters(output_lines: list[str]) -> list[tuple[int, str]]:
    """``(rank, who)`` of the ranks that reported their own failure, in the order of their reports."""
    return [(rank, who) for rank, who, _, _ in _own_reports(output_lines)]


def bystanders(output_lines: list[str]) -> set[int]:
    """Ranks that MPI aborted after noticing another's failure: mpich's ``Abort(c) on node R`` (R the
    world rank) without the rank's own ``jaxhybrid: rank R ... failed`` or watchdog report."""
    aborted = re.findall(r"Abort\(-?\d+\) on node (\d+)", "\n".join(output_lines))
    return {int(r) for r in aborted} - {r for r, _ in reporters(output_lines)}


def failure_summary(watch: RankWatch, output_lines: list[str]) -> str:
    """The launcher's one line on a failed job, from the best evidence there is:
    1. the first rank that reported its own failure (an exception, the watchdog). It aborted the job, and
       MPI_Abort ends the other ranks while it waits, so it is seldom the first to end. Where no rank
       failed and a watchdog fired while its rank waited for a message from a peer, that peer is named: it
       is the one that stopped (the first watchdog to fire may be another rank's, idle in a collective);
    2. the first rank to end abnormally (:meth:`RankWatch.first_abnormal`), e.g. one the OOM killer took;
    3. hydra's ``PID n`` lines, named from the PID files (:func:`name_hydra_pids`), when the watcher saw
       no rank end abnormally;
    4. the first error a rank printed (``jaxhybrid train: error: ...``): ranks that fail before they make
       their topology leave no PID file to watch, and those that fail later with such an error exit
       through Python's exit handlers, leaving the normal-exit marker before mpi4py aborts;
    5. hydra's ``APPLICATION TIMED OUT`` line: no rank failed, the job outlived ``MPIEXEC_TIMEOUT``."""
    own = _own_reports(output_lines)
    if own:
        failed = [who for _, who, what, _ in own if what == "failed"]
        waits = [(m.group(1), who) for _, who, _, line in own for m in [_WAITED_FOR.search(line)]
                 if m and m.group(1) != who]
        if waits and not failed:  # a stuck rank: its peers' watchdogs name it; it may not report at all
            return (f"{waits[0][0]} made no progress: {waits[0][1]} waited for it past its watchdog deadline "
                    f"(its report is above)")
        return f"{(failed or [own[0][1]])[0]} reported the failure first (its message is above)"
    first = watch.first_abnormal(bystanders(output_lines))
    if len(first) > 1:  # ended before the watcher woke: their order is unknown
        return f"{', '.join(first)} ended abnormally, together the first ranks to end"
    if first:
        return f"{first[0]} ended abnormally, the first rank to end"
    named = name_hydra_pids(output_lines, watch.pid_dir)
    if named:
        return f"{', '.join(named)} ended abnormally (hydra's report)"
    errors = [line.strip() for line in output_lines if _SETUP_ERROR.match(line)]
    if errors:
        who = "every rank" if len(errors) >= watch.n else f"{len(errors)} of {watch.n} ranks"
        when = "" if read_pid_files(watch.pid_dir) else " before joining the job"  # no topology made
        return f"{who} failed{when}: {errors[0]}"
    timed_out = next((line.strip() for line in output_lines if TIMED_OUT in line), None)
    if timed_out:
        return (f"the job ran past its time limit ({timed_out}); no rank failed first: raise --timeout "
                f"(MPIEXEC_TIMEOUT), or look for a rank waiting on a peer (pipeline.watchdog_s)")
    return "no rank was seen to end first"


def _rank_of(who: str) -> int:
    m = re.match(r"rank (\d+)", who)
    return int(m.group(1)) if m else -1


def name_hydra_pids(output_lines: list[str], pid_dir: Path) -> list[str]:
    """Hydra's ``PID n RUNNING AT`` lines -> ``rank r (...) (pid n)`` using the ranks' PID files."""
    names = read_pid_files(pid_dir)
    out = []
    for line in output_lines:
        m = re.search(r"PID (\d+) RUNNING AT", line)
        if m and int(m.group(1)) in names:
            out.append(f"{names[int(m.group(1))]} (pid {m.group(1)})")
    return out
