"""What ``jaxhybrid launch`` says and returns when its job outlives ``--timeout``, end to end through the
venv's mpiexec.

Two faults: the launcher kept only some of the job's lines for its summary (hydra's ``RUNNING AT``,
mpich's ``Abort(``, the ranks' ``jaxhybrid`` reports) and dropped hydra's ``APPLICATION TIMED OUT`` line,
the one its summary reads to say that the time limit ended the job, so it said ``no rank was seen to end
first``; and mpich's hydra itself sometimes exits 0 after a timeout, which the launcher passed on as
success, silently."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("run", range(3))  # hydra's exit code after a timeout varies from run to run
def test_a_job_past_its_timeout_fails_and_is_named_as_such(tmp_path, run):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "launch", "-n", "1", "--timeout", "1", "--no-bind",
                        "--script", str(script)], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and lines, (r.returncode, r.stdout, r.stderr)
    assert lines[-1].startswith("jaxhybrid launch: the job ran past its time limit ("), r.stderr
    assert "APPLICATION TIMED OUT" in lines[-1] and "raise --timeout" in lines[-1], r.stderr


def test_sigint_to_the_launcher_alone_stops_the_job(tmp_path):
    """SIGINT sent to `jaxhybrid launch` alone (``kill -INT``, ``timeout -s INT``, a supervisor; no terminal
    that signals mpiexec's process group too) was swallowed: the job trained to its last step, and the
    launcher then said ``stopped by SIGINT (exit code 0)``. It now passes the signal on, as it does SIGTERM,
    and the ranks stop after a saved step. The launcher runs in a session of its own, with no controlling
    terminal, as under a supervisor."""
    import os
    import signal
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "120", "--config",
           str(root / "configs" / "runs" / "tiny.yaml"), "--set", "parallel.data=2", "--set", "train.steps=100000",
           "--set", f"run.dir={run}", "--set", "train.eval_every=0", "--set", "metrics.tensorboard=false"]
    env = {**os.environ, "MPIEXEC_TIMEOUT": "120"}
    p = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        metrics, deadline = run / "metrics.jsonl", time.time() + 120
        while time.time() < deadline and p.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its session: the launcher, mpiexec and the ranks
    assert p.returncode == 130, (out[-2000:], err[-2000:])
    assert err.strip().splitlines()[-1] == "jaxhybrid launch: stopped by SIGINT (exit code 130)", err[-2000:]
    steps = [sorted(int(d.name) for d in (run / "checkpoints" / f"rank_{r}").iterdir()) for r in (0, 1)]
    assert steps[0] == steps[1] and steps[0][-1] < 100000, steps


def test_sigkill_to_the_launcher_stops_the_job(tmp_path):
    """SIGKILL to `jaxhybrid launch` (an OOM kill, a hard kill of a job step) left mpiexec and the ranks running,
    re-parented to init: with metrics.progress=false they trained on and wrote checkpoints. mpiexec now gets
    SIGTERM with the launcher's death and passes it on: the ranks stop within seconds."""
    import os
    import signal
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "300", "--config",
           str(root / "configs" / "runs" / "tiny.yaml"), "--set", "parallel.data=2", "--set", "train.steps=100000",
           "--set", f"run.dir={run}", "--set", "train.eval_every=0", "--set", "metrics.tensorboard=false",
           "--set", "metrics.progress=false"]
    p = subprocess.Popen(cmd, env={**os.environ, "MPIEXEC_TIMEOUT": "300"}, cwd=root, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)

    def job_alive() -> bool:  # any process of the job's session that has not ended (zombies excluded)
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if d.name.isdigit() and int(stat[3]) == p.pid and stat[0] != "Z":  # field 6: the session
                return True
        return False

    try:
        metrics, deadline = run / "metrics.jsonl", time.time() + 270
        while time.time() < deadline and p.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.2)
        assert p.poll() is None, "the job ended before it could be killed"
        p.kill()
        p.wait()
        deadline = time.time() + 30
        while job_alive() and time.time() < deadline:
            time.sleep(0.2)
        assert not job_alive(), "mpiexec or a rank outlived the launcher by 30 s"
    finally:
        if job_alive():
            os.killpg(p.pid, signal.SIGKILL)
    # The stop may cut a save short: mpiexec, writing the ranks' last lines into the dead launcher's pipe, ends
    # too. Such a save is a temporary folder that a resume removes; the committed steps are whole.
    lines = len(metrics.read_text().splitlines())
    time.sleep(2)
    assert len(metrics.read_text().splitlines()) == lines < 100000
