"""One job per run directory: ``<run.dir>/run.lock`` names its holder (host, PID, start time).

Two jobs on one run directory interleave their checkpoints and replace each other's metrics. The writer
rank creates the lock with ``O_EXCL`` before it reads or writes anything there and removes it when the run
ends; a second job meets it and is refused with the holder's name. A lock left by a job that died (a
SIGKILL, an OOM kill) is taken over when its holder is provably gone: a PID of this host that no longer
runs, or runs a process started at another time (a reused PID). A holder on another host cannot be
probed from here, so that lock is only named, with the file to delete.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from jaxhybrid.core.errors import ConfigError

LOCK = "run.lock"


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # fields after the command name, which may hold spaces


def _alive(holder: dict) -> bool:
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    except (OverflowError, ValueError):
        return False
    recorded, now = holder.get("pid_start"), _start_ticks(pid)
    return recorded is None or now is None or recorded == now


class RunLock:
    """The lock of ``run_dir``, taken by :meth:`acquire` and given back by :meth:`release`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_ticks(os.getpid()),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or damaged: treated as held by an unknown job

    def _taken_over(self, holder: dict) -> bool:
        """Whether a lock held by ``holder`` may be taken: its holder is a process of this host that is gone."""
        return holder.get("host") == self.me["host"] and not _alive(holder)

    def check_free(self) -> None:
        """Raise the refusal :meth:`acquire` would raise now, taking nothing (``jaxhybrid launch``'s check
        before mpiexec: one line instead of one aborted rank per rank)."""
        holder = self._holder()
        if holder is not None and not self._taken_over(holder):
            raise ConfigError(self._refusal(holder))

    def acquire(self) -> RunLock:
        """Take the lock, or raise a ConfigError naming the job that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(self.me)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = self._holder()
            if holder is None:  # released meanwhile
                return self.acquire()
            if not self._taken_over(holder):
                raise ConfigError(self._refusal(holder)) from None
            # A dead holder: replace its file in one rename, then check that this job's landed (two jobs that
            # found it dead at once both rename; the later one wins, the other is refused).
            tmp = self.path.with_name(f"{LOCK}.{os.getpid()}")
            tmp.write_text(body)
            os.replace(tmp, self.path)
            if self._holder() != self.me:
                raise ConfigError(self._refusal(self._holder() or {})) from None
            print(f"jaxhybrid: took over {self.path} from pid {holder['pid']} on {holder['host']} (started "
                  f"{holder.get('started')}), which no longer runs", file=sys.stderr, flush=True)
            return self
        with os.fdopen(fd, "w") as f:
            f.write(body)
        return self

    def _refusal(self, holder: dict) -> str:
        if not holder:
            return (f"{self.path.parent} is in use: {self.path} names no job it can read; if no job trains into "
                    f"this run.dir, delete {self.path}")
        where = "" if holder.get("host") == self.me["host"] else " (another host: it cannot be probed from here)"
        return (f"{self.path.parent} is in use by another job: pid {holder.get('pid')} on {holder.get('host')}"
                f"{where}, started {holder.get('started')} ({self.path}); wait for it to end or train into another "
                f"run.dir; if that job is gone, delete {self.path}")

    def release(self) -> None:
        """Remove the lock if it is still this job's."""
        if self._holder() == self.me:
            self.path.unlink(missing_ok=True)
