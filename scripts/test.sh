#!/usr/bin/env bash
# Install on first use (scripts/setup.sh), then run the whole test suite: unit, parity and MPI tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k schedule
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
export MPIEXEC_TIMEOUT="${MPIEXEC_TIMEOUT:-300}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MPLBACKEND=Agg
export JAXHYBRID_CACHE="${JAXHYBRID_CACHE:-$root/.cache}"
# One persistent XLA cache for the session: the pytest process (tests build the same stages in new jit
# objects), MPI ranks and `jaxhybrid train` runs load an identical program instead of compiling it again.
# Every program, not only those over 1 s: on 2 cores with 4 ranks most compile in less.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$JAXHYBRID_CACHE/xla}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@" tests
