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
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@" tests
