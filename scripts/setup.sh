#!/usr/bin/env bash
# Create .venv and install jaxhybrid with everything it needs. Idempotent: re-running is cheap.
# On a GPU machine (nvidia-smi works and CUDA headers exist) it installs jax[cuda12] and builds
# mpi4jax's CUDA bridge; elsewhere it builds mpi4jax without it (nvcc alone, without the CUDA headers,
# fails mpi4jax's CUDA build).
# Without network: JAXHYBRID_WHEELS=DIR [PYTHON=python3] scripts/setup.sh makes .venv over that Python's
# own packages (its JAX, with its CUDA) and installs what it lacks from DIR, which scripts/wheelhouse.sh
# filled on a machine with network.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
stamp=.venv/.jaxhybrid-installed
want="$( (cat pyproject.toml scripts/setup.sh; echo "${JAXHYBRID_WHEELS:-}") | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
wheels="${JAXHYBRID_WHEELS:-}"  # offline: a wheelhouse, over $PY's own packages
export PATH="$root/.venv/bin:$PATH"
has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || { echo "setup: JAXHYBRID_WHEELS=$wheels is not a folder (scripts/wheelhouse.sh makes one)" >&2; exit 2; }
  wheels="$(cd "$wheels" && pwd)"
  # Without ensurepip (a Debian python3 without python3-venv) $PY's own pip installs into the venv.
  [ -x .venv/bin/python ] || "$PY" -m venv .venv || { rm -rf .venv; "$PY" -m venv --without-pip .venv; }
  # $PY's own packages after the venv's, by a .pth: --system-site-packages would miss them when $PY is
  # itself a venv's (a container's python3 often is). The venv's mpi4py comes first, with its mpich.
  site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$PY" -c 'import site; print("\n".join("import site; site.addsitedir(%r)" % d for d in site.getsitepackages()))' \
    > "$site/_jaxhybrid_offline_site.pth"
  if .venv/bin/python -m pip --version >/dev/null 2>&1; then
    pip() { .venv/bin/python -m pip "$@" --no-index --find-links "$wheels"; }
  else  # pip 22.3 or later
    pip() { "$PY" -m pip --python "$root/.venv/bin/python" "$@" --no-index --find-links "$wheels"; }
  fi
  reqs="$(.venv/bin/python scripts/requirements.py --build)"  # an error (no JAX here) ends the setup
  lacking="$(printf '%s\n' "$reqs" | grep -v '^mpi4jax' || true)"  # mpi4jax builds below
  if [ -n "$lacking" ]; then
    # shellcheck disable=SC2086  # one requirement per line, none with spaces
    pip install -q --no-deps $lacking
  fi
  pip install -q --no-deps --no-build-isolation -e .
else
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pip() { .venv/bin/python -m pip "$@"; }
  pip install -q --upgrade pip wheel setuptools
  if [ "$has_gpu" = 1 ]; then
    pip install -q "jax[cuda12]>=0.10.2,<0.11"
  fi
  pip install -q -e ".[test]"
fi
if ! .venv/bin/python -c "import mpi4jax" >/dev/null 2>&1; then
  # mpi4jax compiles against the mpicc found first on PATH (the mpich wheel's, in .venv/bin) and the
  # mpi4py already installed, so its build runs without isolation and needs its build tools here.
  pip install -q nanobind cython
  cuda_hdr=""
  nvcc_root="$(dirname "$(dirname "$(command -v nvcc || echo /none/bin/nvcc)")")"  # a toolkit not at /usr/local/cuda
  for d in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda "$nvcc_root"; do
    if [ -n "$d" ] && [ -f "$d/include/cuda_runtime.h" ]; then cuda_hdr="$d"; break; fi
  done
  if [ "$has_gpu" = 1 ] && [ -n "$cuda_hdr" ]; then
    CUDA_PATH="$cuda_hdr" pip install -q --no-build-isolation "mpi4jax>=0.9,<0.10"
  else
    # No usable CUDA headers: an empty CUDA_PATH makes mpi4jax skip its CUDA bridge.
    empty="$(mktemp -d)"
    CUDA_PATH="$empty" pip install -q --no-build-isolation "mpi4jax>=0.9,<0.10"
  fi
fi
.venv/bin/python -c "import jax, flax, optax, mpi4py, mpi4jax, orbax.checkpoint, tokenizers; print('jaxhybrid setup ok: jax', jax.__version__, 'mpi4jax', mpi4jax.__version__)"
echo "$want" > "$stamp"
