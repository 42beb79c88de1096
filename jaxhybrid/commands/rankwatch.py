"""Which rank of a ``jaxhybrid launch`` job ended first, for the launcher's failure report.

Each rank records ``rank -> pid`` in the directory given by ``JAXHYBRID_PID_DIR`` when its topology is
made, and a ``rank<r>.exit`` marker when its interpreter exits normally (see :mod:`jaxhybrid.topology`).
A rank killed by a signal (the OOM killer, ``kill -9``) leaves no Python message, and hydra's report
is no help: it names the PID of whichever process it saw end, often a bystander that MPI aborted once
its peer vanished (measured: a 2 x 2 job whose rank 3 was killed was reported by the PID of rank 0, in
another run of rank 1). :class:`RankWatch` watches the ranks' PIDs while the job runs and keeps the
order in which they ended, so the launcher can name the first rank that ended without its exit marker
and without mpich's report that it aborted on a peer's failure (:func:`bystanders`); all of them when
several end before the watcher wakes. Hydra's ``PID n`` lines are the fallback
(:func:`name_hydra_pids`), e.g. for a rank that died before it recorded its PID.
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


class RankWatch(threading.Thread):
    """Watches the PIDs of the ``n`` ranks (their PID files are read until all ``n`` appeared) and records
    the order in which they end: ``ended`` is a list of ``(wake-up number, pid, who)``. Where the kernel
    has pidfds (Linux 5.3) the thread sleeps in ``poll`` on them and wakes at the first exit; hydra needs
    longer to stop the other ranks, so the first rank usually ends alone in its wake-up (a 2-core machine
    starved a 20 ms polling loop enough that bystanders often shared its tick). Elsewhere it polls."""

    def __init__(self, pid_dir: Path, n: int, period_s: float = 0.02):
        super().__init__(daemon=True, name="jaxhybrid-rankwatch")
        self.pid_dir, self.n, self.period_s = Path(pid_dir), n, period_s
        self.ended: list[tuple[int, int, str]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        names: dict[int, str] = {}  # every rank seen so far
        live: dict[int, int | None] = {}  # pid -> its pidfd (None: polled)
        poller, tick = select.poll(), 0
        try:
            while not self._halt.is_set():
                if len(names) < self.n:
                    for pid, who in read_pid_files(self.pid_dir).items():
                        if pid not in names:
                            names[pid] = who
                            live[pid] = _pidfd(pid)
                            if live[pid] is not None:
                                poller.register(live[pid], select.POLLIN)
                ready = {fd for fd, _ in poller.poll(self.period_s * 1000)}
                tick += 1
                gone = sorted(p for p, fd in live.items() if (fd in ready if fd is not None else not _alive(p)))
                for pid in gone:
                    fd = live.pop(pid)
                    if fd is not None:
                        poller.unregister(fd)
                        os.close(fd)
                    self.ended.append((tick, pid, names[pid]))
        finally:
            for fd in live.values():
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


def bystanders(output_lines: list[str]) -> set[int]:
    """Ranks that MPI aborted after noticing another's failure: mpich's ``Abort(c) on node R`` (R the
    world rank) without the rank's own ``jaxhybrid: rank R ... failed`` or watchdog report."""
    text = "\n".join(output_lines)
    aborted = re.findall(r"Abort\(-?\d+\) on node (\d+)", text)
    own = re.findall(r"jaxhybrid(?: watchdog)?: rank (\d+) .*(?:failed|made no progress)", text)
    return {int(r) for r in aborted} - {int(r) for r in own}


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
