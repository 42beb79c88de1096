"""Two CPU processes form one 8-device mesh through jax.distributed (gloo) and match the single device."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two fresh JAX processes compiling on 2 cores: about 40 s of CPU
def test_two_processes_one_mesh(shape="2,1,2,2"):
    """data=2 spans the two processes (process-major device order); row x col stay inside each."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "jaxhybrid.tensor.distributed", "--port", str(port), "--shape", shape,
           "--num-processes", "2", "--local-devices", "4"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: loss" in out and "matches the single-device step" in out
