#!/usr/bin/env bash
# The GPU check, for a machine with one GPU, at most 8 minutes: a bf16 GPT-2-small run (loss, MFU), a
# 2-rank MPI pipeline sharing the GPU against the single GPU (loss parity, float32), and the offloaded
# optimizer (losses and device bytes against the on-device update). Prints one JSON object, also written
# to runs/gpu_check/gpu_check.json; what it does and skips is in scripts/gpu_check.py.
#   scripts/gpu_check.sh            on the GPU, in the venv that scripts/setup.sh made, else python3's JAX
#   scripts/gpu_check.sh --cpu      the same steps on the CPU with a tiny model (the script's self-test)
# A machine without network and venv: PYTHON=python3 scripts/gpu_check.sh uses that Python's own packages
# (the pipeline is skipped without mpi4jax and MPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  bash scripts/setup.sh
  py="$root/.venv/bin/python"
fi
export PATH="$(dirname "$py"):$PATH"
export MPLBACKEND=Agg OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export JAXHYBRID_CACHE="${JAXHYBRID_CACHE:-$root/.cache}"
if ! err="$(PYTHONPATH="$root" "$py" -c 'import jaxhybrid.runtime.trainer' 2>&1)"; then
  echo "gpu_check: $py cannot import jaxhybrid's trainer (scripts/setup.sh installs what it needs):" >&2
  echo "$err" | tail -3 >&2
  exit 2
fi
exec timeout 480 "$py" scripts/gpu_check.py "$@"
