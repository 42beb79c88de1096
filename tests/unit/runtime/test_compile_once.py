"""``JAXHYBRID_COMPILE_ONCE`` (jaxhybrid.runtime.compile_once): a process that misses the persistent cache
while another compiles the same program waits for it and loads its executable instead of compiling."""
import os
import subprocess
import sys
import time

# Compiles one program (its input a numpy array: no eager op compiles); backend_compile_and_load is wrapped to
# mark its start, hold the compile until the peer process (if named) is about to jit and 3 s more, and count
# the compiles, printed at the end with the result. Holding for the peer, not for a fixed time, keeps the race
# on loaded machines, where B's start-up alone can outlast a fixed hold.
SCRIPT = r"""
import sys, time
from pathlib import Path
from jaxhybrid.cli.commands.train import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax._src import compiler
marker, peer, compiled, real = Path(sys.argv[2]), sys.argv[4], [], compiler.backend_compile_and_load

def slow(*args, **kwargs):
    compiled.append(1)
    marker.touch()
    deadline = time.monotonic() + 120
    while peer != "-" and not Path(peer).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(3)
    return real(*args, **kwargs)

compiler.backend_compile_and_load = slow
Path(sys.argv[3]).touch()  # about to jit
out = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(np.arange(64.0, dtype=np.float32).reshape(8, 8) / 64)
print("COMPILED", len(compiled), "RESULT", float(out))
"""


def _start(cache, marker, ready, peer, once: bool) -> subprocess.Popen:
    env = dict(os.environ, JAXHYBRID_COMPILE_ONCE="1" if once else "0", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(cache), str(marker), str(ready), str(peer)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _race(tmp_path, once: bool) -> list[str]:
    """Process B starts while process A is inside the compile of the same program; both outputs."""
    cache, marker = tmp_path / "xla", tmp_path / "a-compiling"
    a = _start(cache, marker, tmp_path / "a-ready", tmp_path / "b-ready", once)
    deadline = time.monotonic() + 120
    while not marker.exists() and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    b = _start(cache, tmp_path / "b-compiling", tmp_path / "b-ready", "-", once)
    outs = []
    for p in (a, b):
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.strip().splitlines()[-1])
    return outs


def test_a_process_waits_for_the_same_program_and_loads_it(tmp_path):
    a, b = _race(tmp_path, once=True)
    assert a.startswith("COMPILED 1 ") and b.startswith("COMPILED 0 "), (a, b)
    assert a.split("RESULT")[1] == b.split("RESULT")[1]
    assert (tmp_path / "xla.locks").exists()  # beside the cache, not in it (JAX's bounded cache counts files)


def test_without_it_both_processes_compile(tmp_path):
    """The control: JAX alone lets B miss the cache while A compiles, so B compiles the program too."""
    a, b = _race(tmp_path, once=False)
    assert a.startswith("COMPILED 1 ") and b.startswith("COMPILED 1 "), (a, b)
