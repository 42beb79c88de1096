#!/usr/bin/env bash
# Install on first use (scripts/setup.sh), then run the default job. Extra arguments go to
# `jaxhybrid train`, e.g. scripts/train.sh --set train.steps=50
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -x .venv/bin/jaxhybrid ] || bash scripts/setup.sh
bash scripts/setup.sh
export PATH="$root/.venv/bin:$PATH"
export MPLBACKEND=Agg
export JAXHYBRID_CACHE="${JAXHYBRID_CACHE:-$root/.cache}"
exec .venv/bin/jaxhybrid train --config "${JAXHYBRID_CONFIG:-configs/runs/tiny.yaml}" "$@"
