#!/usr/bin/env bash
# Install on first use (scripts/setup.sh), then run the whole test suite: unit, parity and MPI tests.
#   scripts/test.sh --quick [pytest args]: the daily check, the unit tests without the MPI ones and without
#     those marked slow (each over ~20 s on 2 cores: subprocess trainings, multi-device compiles), on the
#     xdist workers as below; under 5 minutes on 2 cores. Extra arguments narrow it (-k plan, -x).
# Other extra arguments go to one pytest run, e.g. scripts/test.sh -k schedule (over tests/) or
# scripts/test.sh tests/unit/runtime/test_data.py (that file only)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
export MPIEXEC_TIMEOUT="${MPIEXEC_TIMEOUT:-300}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MPLBACKEND=Agg
export JAXHYBRID_CACHE="${JAXHYBRID_CACHE:-$root/.cache}"
quick=
if [ "${1:-}" = "--quick" ]; then shift; quick=1; fi
if [ -n "$quick" ] || [ "$#" -gt 0 ]; then  # a selection (--quick, -k, a file): one run
  # Over tests/ (--quick: tests/unit) unless the arguments name test paths themselves (a file, a folder,
  # file::test): appending the folder to those would run the whole suite beside them.
  where=tests
  [ -z "$quick" ] || where=tests/unit
  for a in "$@"; do
    case "$a" in -*) ;; *) if [ -e "${a%%::*}" ]; then where=; fi ;; esac
  done
  if [ -n "$quick" ]; then
    exec .venv/bin/python -m pytest -q -rs --durations=15 -n auto --maxprocesses 4 --dist worksteal \
      -m "not slow and not mpi" "$@" $where
  fi
  exec .venv/bin/python -m pytest -q -rs --durations=15 "$@" $where  # in order
fi
# The unit and parity tests on up to 4 cores, one pytest-xdist worker each (every worker its own JAX with 8
# fake devices; the XLA cache is shared under its file lock); then the MPI tests, three jobs at a time: a job's
# ranks wait on each other (a pipeline's bubbles, one rank's compile, rank 0's single-device reference) and the
# other jobs fill those gaps. Tests that share a run stay on one worker (tests/mpi/xdist_scopes.py). Last, alone,
# the MPI tests that time how fast a failing job ends (marked `timed`). One pool for the unit and the MPI tests
# was slower than the two in turn (docs/performance.md, "Test infrastructure").
# Every part runs whatever the others give; the status is the first failing part's.
rc=0
.venv/bin/python -m pytest -q -rs --durations=15 -n auto --maxprocesses 4 --dist worksteal tests/unit tests/parity \
  || rc=$?
mpi() { .venv/bin/python -m pytest -q -rs --durations=15 "$@" tests/mpi; }
mpi -n 3 --dist loadscope -m "not timed" || { [ "$rc" -ne 0 ] || rc=$?; }
mpi -m timed || { [ "$rc" -ne 0 ] || rc=$?; }
exit "$rc"
