#!/usr/bin/env bash
# Gather, on a machine with network, what a machine without one (an air-gapped cluster, a container image)
# needs beside its own Python and JAX: wheels for that Python of what it lacks, and mpi4jax's source,
# which builds there against its JAX and, on GPUs, CUDA. Then, on that machine:
#   JAXHYBRID_WHEELS=DIR PYTHON=python3 scripts/setup.sh        (or scripts/gpu_check.sh, scripts/train.sh)
# Usage: scripts/wheelhouse.sh DIR [PYTHON_VERSION [HAVE_FILE]]
#   PYTHON_VERSION  the offline Python's version, e.g. 3.12 (default: this python3's)
#   HAVE_FILE       its `python3 -m pip list --format=freeze` (or names, one a line): what it has is not
#                   fetched (default: all but JAX)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
dir="$(mkdir -p "$1" && cd "$1" && pwd)"
version="${2:-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
have="${3:-}"
if [ -z "$have" ]; then  # nothing known of that Python but its JAX: fetch all the rest
  have="$(mktemp)"
  printf 'jax\njaxlib\n' > "$have"
fi
py="${PYTHON:-python3}"
mapfile -t wanted < <("$py" "$root/scripts/requirements.py" --have "$have" --build)
binary=(--only-binary=:all: --python-version "$version" --implementation cp --abi "cp${version/./}" --abi abi3
        --abi none --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any)
for req in "${wanted[@]}"; do
  [ -n "$req" ] || continue
  if [[ "$req" == mpi4jax* ]] || ! "$py" -m pip download -q --no-deps "${binary[@]}" -d "$dir" "$req" 2>/dev/null; then
    # No wheel for that Python: its source. mpi4jax always builds there; a pure-Python one is built here.
    "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$dir" "$req"
    if [[ "$req" != mpi4jax* ]]; then
      sdist="$(ls -t "$dir"/*.tar.gz | head -1)"
      "$py" -m pip wheel -q --no-deps -w "$dir" "$sdist" && rm "$sdist"
    fi
  fi
done
echo "wheelhouse: $dir for Python $version: ${wanted[*]:-nothing to fetch}" >&2
ls "$dir"
