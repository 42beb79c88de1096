"""``jaxhybrid bench offload --tensor``: the on-device baseline's update compiles once, in the untimed
warm-up step. Its optimizer state was left uncommitted (the trainer commits it: ``build.committed``), so
the update compiled again on its second call, inside the first timed round, and with ``--rounds 1`` the
baseline's step time and the offload ratio were off by several times."""
from __future__ import annotations

import os
import subprocess
import sys


def test_baseline_update_compiles_once():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_LOG_COMPILES="1", JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "bench", "offload", "--tensor", "1,1,1,2",
                        "--steps", "1", "--rounds", "1", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # DeviceUpdater.apply is the baseline's one jit(apply); the offloaded updater's buckets run jit(update).
    compiles = [line for line in r.stderr.splitlines() if "Compiling jit(apply)" in line]
    assert len(compiles) == 1, f"{len(compiles)} compiles of the baseline's update:\n" + "\n".join(
        c[:300] for c in compiles)
