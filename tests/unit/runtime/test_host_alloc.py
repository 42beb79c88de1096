"""``jaxhybrid.runtime.host_alloc``: with glibc's malloc tuned, a program's 64 MiB temporary stops costing a page
fault per page on every call. Each probe is a fresh process: the settings must precede JAX's backend."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxhybrid.runtime.host_alloc import OPT_OUT, _skip_reason, cpu_devices
from jaxhybrid.runtime.host_alloc import glibc as is_glibc

glibc = pytest.mark.skipif(not is_glibc(), reason="the tuning is glibc's")

PROBE = textwrap.dedent("""
    import json, resource
    from jaxhybrid.runtime.host_alloc import configure_host_malloc
    status = configure_host_malloc()
    import jax, jax.numpy as jnp
    f = jax.jit(lambda a, b, c: (a @ b) @ c)  # a @ b: a 64 MiB temporary of every call
    a, b, c = jnp.ones((4096, 16)), jnp.ones((16, 4096)), jnp.ones((4096, 1))
    temp = f.lower(a, b, c).compile().memory_analysis().temp_size_in_bytes
    for _ in range(20):  # glibc's heap settles within a few calls
        f(a, b, c).block_until_ready()
    windows = []  # page faults per call over 5 windows of 4 calls
    for _ in range(5):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            f(a, b, c).block_until_ready()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 4)
    print(json.dumps({"status": status, "temp_pages": temp // 4096, "faults_per_call": windows}))
""")


def _probe(**env) -> dict:
    """The probe in a fresh process with one CPU device (as ``jaxhybrid train`` runs by default)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", OPT_OUT, "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_tuned_malloc_keeps_a_large_temporary_mapped_between_calls():
    tuned, system = _probe(), _probe(**{OPT_OUT: "system"})
    assert tuned["status"] == {"applied": True, "M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": -1}
    assert system["status"] == {"applied": False, "reason": f"{OPT_OUT}=system"}
    pages = tuned["temp_pages"]
    assert pages >= 16384, tuned  # the probe really has a 64 MiB temporary
    # glibc's defaults mmap it afresh per call: every page faults in every window. Tuned, it stays in the
    # heap: a settled window has no faults. Why the best window and not one long one: on a loaded machine
    # the heap may still grow now and then, faulting in part of the pages of a few calls.
    assert min(system["faults_per_call"]) > 0.9 * pages, system
    assert min(tuned["faults_per_call"]) < 0.05 * pages, tuned
    several = _probe(XLA_FLAGS="--xla_force_host_platform_device_count=4")["status"]
    assert several == {"applied": True, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": -1}, several  # per-thread arenas


def test_skipped_with_the_reason_named():
    assert _skip_reason({OPT_OUT: "system"}) == f"{OPT_OUT}=system"
    assert "MALLOC_ARENA_MAX" in _skip_reason({"MALLOC_ARENA_MAX": "4"})
    assert "GLIBC_TUNABLES" in _skip_reason({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    if is_glibc():  # an accelerator backend is checked after the platform
        assert "JAX_PLATFORMS=cuda" in _skip_reason({"JAX_PLATFORMS": "cuda"})


@glibc
def test_too_late_once_jax_runs():
    jax.devices()  # the backend's threads already hold their own arenas
    assert "already started" in _skip_reason({})


def test_one_arena_only_for_a_single_cpu_device():
    """Several fake CPU devices in one process keep per-thread arenas (one arena serialised them)."""
    assert cpu_devices({}) == 1
    assert cpu_devices({"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"}) == 8
    assert cpu_devices({"JAX_NUM_CPU_DEVICES": "4"}) == 4
    assert cpu_devices({"JAX_NUM_CPU_DEVICES": "four"}) == 1  # not this module's error to raise
    # JAX's CPU client takes jax_num_cpu_devices over the flag (a rank saw 2 devices, not 8).
    assert cpu_devices({"JAX_NUM_CPU_DEVICES": "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}) == 2


def test_a_device_count_flag_that_is_no_number_is_one_error(tmp_path):
    """``XLA_FLAGS=--xla_force_host_platform_device_count=abc``: `jaxhybrid train` ended in XLA's fatal
    flag-parse abort and a 90-line dump of every XLA flag, and `jaxhybrid launch` said "your  (kept by the
    launcher) gives each of the 4 ranks 1 CPU device(s)", naming nothing. Now both stop with one line."""
    with pytest.raises(ValueError, match=r"^XLA_FLAGS sets --xla_force_host_platform_device_count=abc: "):
        cpu_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=abc"})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=abc"}
    for argv in (["train", "--config", "configs/runs/tiny.yaml", "--set", f"run.dir={tmp_path}/run"],
                 ["launch", "-n", "4", "--dry-run", "--", "--config", "configs/runs/hybrid.yaml"]):
        r = subprocess.run([sys.executable, "-m", "jaxhybrid", *argv], env=env, cwd=root, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
        assert r.stderr.startswith(f"jaxhybrid {argv[0]}: error: XLA_FLAGS sets "
                                   f"--xla_force_host_platform_device_count=abc: "), r.stderr[-3000:]


CLI_PROBE = textwrap.dedent("""
    import json, os, sys
    import jaxhybrid.cli.commands.bench as bench
    from jaxhybrid.cli.main import main
    from jaxhybrid.runtime.host_alloc import host_malloc_status
    bench.run = lambda args: print(json.dumps({"status": host_malloc_status(),
                                               "flags": os.environ.get("XLA_FLAGS", "")})) or 0
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
@glibc
@pytest.mark.parametrize("argv,devices", [(["bench", "tensor", "--devices", "4"], 4),
                                          (["bench", "offload", "--tensor", "2,1,1,2"], 4),
                                          (["bench", "stage"], 1)])
def test_cli_settles_a_benchmarks_devices_before_tuning(argv, devices):
    """A benchmark that runs on fake CPU devices sets them before the tuning reads their count: one arena
    only where one device runs."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", OPT_OUT, "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", CLI_PROBE, *argv], env=base, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpu_devices({"XLA_FLAGS": got["flags"]}) == devices
    assert got["status"]["applied"] and ("M_ARENA_MAX" in got["status"]) == (devices == 1), got
