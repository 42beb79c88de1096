#!/usr/bin/env bash
# Install on first use (scripts/setup.sh), then run the default job: a 2 x 2 grid (2 pipeline stages x
# 2 data replicas) of MPI ranks training a tiny GPT with 1F1B + 2BP on the built-in corpus.
# Extra arguments go to `jaxhybrid train`, e.g. scripts/train.sh --set train.steps=50
# JAXHYBRID_RANKS=1 JAXHYBRID_CONFIG=configs/runs/tiny.yaml scripts/train.sh runs the single-process job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
export MPLBACKEND=Agg
export JAXHYBRID_CACHE="${JAXHYBRID_CACHE:-$root/.cache}"
config="${JAXHYBRID_CONFIG:-configs/runs/pipeline_2x2.yaml}"
ranks="${JAXHYBRID_RANKS:-4}"
if [ "$ranks" = 1 ]; then
  exec .venv/bin/jaxhybrid train --config "$config" "$@"
fi
exec .venv/bin/jaxhybrid launch -n "$ranks" --timeout "${JAXHYBRID_TIMEOUT:-3600}" -- --config "$config" "$@"
