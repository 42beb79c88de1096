#!/usr/bin/env bash
# The GPU check, for a machine with one GPU, at most 8 minutes: a bf16 GPT-2-small run (loss, MFU), a
# 2-rank MPI pipeline sharing the GPU against the single GPU (loss parity, float32), and the offloaded
# optimizer (losses and device bytes against the on-device update). Prints one JSON object, also written
# to runs/gpu_check/gpu_check.json; what it does and skips is in scripts/gpu_check.py.
#   scripts/gpu_check.sh            on the GPU, in the venv that scripts/setup.sh made, else python3's JAX
#   scripts/gpu_check.sh --cpu      the same steps on the CPU with a tiny model (the script's self-test)
# A machine without network: JAXHYBRID_WHEELS=DIR PYTHON=python3 scripts/gpu_check.sh installs over that
# Python's own packages and JAX what it lacks, from the wheelhouse DIR that scripts/wheelhouse.sh made; with
# PYTHON alone it uses that Python's packages as they are (the pipeline is skipped without MPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ] || [ -n "${JAXHYBRID_WHEELS:-}" ]; then
  bash scripts/setup.sh  # with JAXHYBRID_WHEELS: offline, over $PYTHON's own packages and JAX
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
