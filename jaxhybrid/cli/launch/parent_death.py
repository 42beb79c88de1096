"""mpiexec ends with the launcher: a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``).

Killed with SIGKILL (an OOM kill, a hard kill of a job step), ``jaxhybrid launch`` can forward nothing:
mpiexec and the ranks were re-parented to init and trained on, writing checkpoints into a run directory
that nobody watched. With the parent-death signal the kernel sends mpiexec SIGTERM the moment the
launcher is gone, and mpiexec passes it to the ranks, which stop after their step with it saved
(:mod:`jaxhybrid.runtime.stop`), as when the launcher forwards a SIGTERM itself.
"""
from __future__ import annotations

import os
import sys

# Run as ``python -c ARM <launcher pid> mpiexec ...``: arm the signal (PR_SET_PDEATHSIG = 1; it survives exec),
# stop at once if the launcher is already gone (the signal would never come), then become mpiexec. A small
# interpreter in between, since Popen's preexec_fn is unsafe in a launcher that runs threads (its rank watch).
ARM = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
       "os.getppid() == int(sys.argv[1]) or os.kill(os.getpid(), signal.SIGTERM); os.execvp(sys.argv[2], sys.argv[2:])")


def with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it receives SIGTERM when this process dies (on Linux; elsewhere ``cmd`` as it is)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", ARM, str(os.getpid()), *cmd]
