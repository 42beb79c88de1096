"""A launcher killed with SIGKILL takes mpiexec with it (the kernel's parent-death signal)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxhybrid.cli.launch.parent_death import with_parent_death_signal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _state(pid: int) -> str | None:
    """The process's state letter (Z: ended, not reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_the_child_ends_when_its_launcher_is_killed():
    """Without it, mpiexec and the ranks were re-parented to init and trained on."""
    launcher = ("import os, signal, subprocess, time, sys; from jaxhybrid.cli.launch.parent_death import "
                "with_parent_death_signal as w; p = subprocess.Popen(w(['sleep', '300'])); print(p.pid, flush=True); "
                "time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    p.wait()
    deadline = time.time() + 10
    while _state(child) not in (None, "Z") and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert _state(child) in (None, "Z")
    finally:
        if _state(child) not in (None, "Z"):
            os.kill(child, 9)


def test_the_command_is_run_as_given():
    out = subprocess.run(with_parent_death_signal(["echo", "a b", "c"]), capture_output=True, text=True, check=True)
    assert out.stdout == "a b c\n"
